"""``decode.generate``: lossless speculative decoding of one prompt or a batch with an EAGLE head, a draft
model, any ``Drafter``, or none. It builds the drafter (``plan.make_drafter``; one per row for a batch,
``plan.make_row_drafters``) and runs the loop (``loop.run``; ``batch.run_batch`` for a batch)."""
from __future__ import annotations

import torch

from eaglekit.decode.batch import pad_prompts, run_batch
from eaglekit.decode.loop import GenerateOutput, check_context, check_inputs, eos_ids, run
from eaglekit.decode.plan import make_drafter, make_row_drafters
from eaglekit.decode.sampling import Sampling
from eaglekit.decode.stats import BatchStats


@torch.no_grad()
def generate(target, drafter, input_ids, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, eos_token_id=None, stop: list[str] | str | None = None,
             seed: int | None = None, generator: torch.Generator | None = None, tree=None, gamma: int = 4,
             streamer=None, prompt_lookup=0, attention_mask=None, pad_token_id: int | None = None) -> GenerateOutput:
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

    A batch: ``input_ids`` [B, T] left-padded with ``attention_mask`` (0 on the pads), or a list of 1-D
    prompts (left-padded here). Each row decodes as it would alone (``batch.run_batch``: one target
    forward per step for all live rows, a drafter per row, rows ending independently). ``sequences`` is
    then [B, T + max_new_tokens]: row b's new tokens at ``sequences[b, T:]``, then ``pad_token_id`` (default
    the tokenizer's pad, else its EOS, else 0); ``stats`` a ``BatchStats`` (``tau`` the mean over rows,
    ``rows[b]`` row b's own). ``drafter`` may then be a list with one per row. No streamer for a batch.
    """
    if isinstance(input_ids, (list, tuple)) or attention_mask is not None or torch.as_tensor(input_ids).shape[0] > 1:
        return _generate_batch(target, drafter, input_ids, attention_mask, pad_token_id, max_new_tokens,
                               temperature, top_p, top_k, eos_token_id, stop, seed, generator, tree, gamma,
                               streamer, prompt_lookup)
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


def _generate_batch(target, drafter, input_ids, attention_mask, pad_token_id, max_new_tokens, temperature, top_p,
                    top_k, eos_token_id, stop, seed, generator, tree, gamma, streamer, prompt_lookup):
    if streamer is not None:
        raise ValueError("a streamer takes one sequence: decode a batch without one (or one prompt at a time)")
    pad_id = _pad_id(target, pad_token_id)
    ids, starts = pad_prompts(input_ids, attention_mask, pad_id)
    check_context(target, ids.shape[1], max_new_tokens)
    B, T = ids.shape
    if B == 1:  # one prompt: the one-sequence loop (no masks), its output laid out as a batch's
        one = generate(target, drafter[0] if isinstance(drafter, (list, tuple)) else drafter, ids[:, starts[0]:],
                       max_new_tokens, temperature, top_p, top_k, eos_token_id, stop, seed, generator, tree,
                       gamma, None, prompt_lookup)
        seq = torch.full((1, T + max_new_tokens), pad_id, dtype=ids.dtype, device=one.sequences.device)
        seq[:, :T] = ids
        seq[:, T:T + one.stats.new_tokens] = one.sequences[:, T - starts[0]:]
        stats = BatchStats(rows=[one.stats], forwards=len(one.stats.accept_lengths), **vars(one.stats))
        return GenerateOutput(seq, stats)
    sampling = Sampling(temperature, top_p, top_k)
    if generator is None and seed is not None:
        generator = torch.Generator(device=target.device).manual_seed(seed)
    drafters = make_row_drafters(target, drafter, B, sampling, generator, tree=tree, gamma=gamma,
                                 prompt_lookup=prompt_lookup)
    stop = [stop] if isinstance(stop, str) else stop
    return run_batch(target, drafters, ids, starts, max_new_tokens, sampling, generator,
                     eos_ids(target, eos_token_id), stop, pad_id)


def _pad_id(target, pad_token_id) -> int:
    """The id that pads a batch's prompts on the left and its rows after they end."""
    if pad_token_id is not None:
        return int(pad_token_id)
    tok = target.tokenizer
    for candidate in (tok.pad_token_id, tok.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0
