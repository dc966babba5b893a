"""``decode.generate``: lossless speculative decoding of one prompt with an EAGLE head, a draft model, any
``Drafter``, or none. It builds the drafter (``plan.make_drafter``) and runs the loop (``loop.run``)."""
from __future__ import annotations

import torch

from eaglekit.decode.loop import GenerateOutput, check_inputs, eos_ids, run
from eaglekit.decode.plan import make_drafter
from eaglekit.decode.sampling import Sampling


@torch.no_grad()
def generate(target, drafter, input_ids, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, eos_token_id=None, stop: list[str] | str | None = None,
             seed: int | None = None, generator: torch.Generator | None = None, tree=None, gamma: int = 4,
             streamer=None, prompt_lookup=0) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` after ``input_ids`` [1, T] with ``drafter``: None (plain decoding),
    a draft Target sharing the tokenizer (a chain of ``gamma`` tokens), an EAGLE head, or a ``Drafter``
    (e.g. ``ModelTreeDrafter``, ``LookupDrafter``).

    ``tree`` (heads): a ``TreeSpec``, a dict of its fields, a ``plan.Plan``, or ``"auto"`` (sized from
    measured costs, plain decoding where no tree pays; with ``prompt_lookup`` it also keeps fewer head
    nodes on steps that have a lookup branch). ``prompt_lookup=N`` adds a branch of up to N tokens copied
    from the context after its last matching n-gram (``lookup.LookupDrafter``; with ``drafter=None`` this
    is prompt lookup decoding); ``prompt_lookup=(2, 5, 10)`` (``lookup.BY_MATCH``, the measured best) sizes
    the branch by the match: 2 tokens after a 1-gram match, 5 after a 2-gram, 10 after a 3-gram.
    ``eos_token_id`` defaults to the model's generation config (``False`` disables it); ``stop`` strings
    end the generation too. ``seed`` seeds a generator on the target's device. ``streamer`` (a
    transformers streamer) gets the tokens as they are accepted. ``max_new_tokens=0`` returns the prompt
    unchanged.
    """
    input_ids = torch.as_tensor(input_ids)
    check_inputs(target, input_ids, max_new_tokens)
    sampling = Sampling(temperature, top_p, top_k)
    if generator is None and seed is not None:
        generator = torch.Generator(device=target.device).manual_seed(seed)
    eos = eos_ids(target, eos_token_id)
    drafter = make_drafter(target, drafter, sampling, generator, tree=tree, gamma=gamma,
                           prompt_lookup=prompt_lookup)
    stop = [stop] if isinstance(stop, str) else stop
    return run(target, drafter, input_ids, max_new_tokens, sampling, generator, eos, stop, streamer)
