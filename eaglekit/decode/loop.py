"""The decode loop: draft → verify in one target forward → accept → keep → commit. One loop for every drafter.

``run(target, drafter, prompt, ...)`` decodes with a ``drafters.Drafter``; ``decode.generate`` builds one
from a head, a draft model or None (``api.make_drafter``) and calls it. One sequence (a batch of
prompts runs in ``batch.run_batch``, which reuses ``Step`` and ``finish``). ``Decoder`` holds its state;
``run`` adds what ends a generation (max tokens, EOS, stop strings), streaming and the stats.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglekit.decode import kv
from eaglekit.decode.sampling import Sampling, sample
from eaglekit.decode.stats import DecodeStats
from eaglekit.decode.tree import Tree
from eaglekit.decode.verify import accept, accepted_rows, verify
from eaglekit.timing import Stopwatch


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [1, prompt + new]; a batch: [B, T + max_new_tokens], padded after each row ends
    stats: DecodeStats


@dataclass
class Step:
    """What one verify forward decided: the tree it verified, the accepted node indices, the next token."""

    tree: Tree
    path: list[int]
    next_token: int
    draft_s: float = 0.0
    verify_s: float = 0.0  # verify forward, acceptance, KV keep and the drafter's commit

    @property
    def emitted(self) -> list[int]:
        """The accepted nodes' tokens, then the next token (the root of the next step)."""
        return self.tree.path_tokens(self.path) + [self.next_token]


class Decoder:
    """One sequence's decoding state: the target's KV cache, the drafter and how to sample.

    ``prefill(prompt)`` once, then ``step(root, max_depth)`` per target forward. After a step the target's
    cache holds the prompt and every emitted token but the last (the next root)."""

    def __init__(self, target, drafter, sampling: Sampling, generator: torch.Generator | None = None):
        self.target, self.drafter, self.sampling, self.generator = target, drafter, sampling, generator
        self.cache = kv.new_cache(target.model)

    def prefill(self, prompt: torch.Tensor) -> int:
        """Run ``prompt`` [1, T] into the cache; returns the first new token (the first root)."""
        # logits of the last row only: [S, V] logits of a long prompt cost seconds
        out = self.target.forward(prompt, past_key_values=self.cache, kind=self.drafter.kind,
                                  layer_ids=self.drafter.layer_ids, logits_to_keep=1)
        last = out.logits[0, -1]
        root = int(last.argmax()) if self.sampling.greedy else sample(self.sampling.probs(last), self.generator)
        self.drafter.prefill(prompt, out, root)
        return root

    def step(self, root: int, max_depth: int) -> Step:
        """Draft below ``root`` (at most ``max_depth`` deep), verify, accept, keep the accepted rows' KV,
        commit."""
        clock = Stopwatch(self.target.device)
        tree = self.drafter.draft(max_depth)
        draft_s = clock.lap()
        out, past = verify(self.target, self.cache, root, tree, self.drafter)
        path, next_token = accept(out.logits[0], tree, self.sampling, self.generator)
        rows = accepted_rows(path)
        kv.keep(self.cache, past, rows)
        self.drafter.commit(tree, path, next_token, out, rows)
        return Step(tree, path, next_token, draft_s, clock.lap())


@torch.no_grad()
def run(target, drafter, prompt: torch.Tensor, max_new_tokens: int, sampling: Sampling,
        generator: torch.Generator | None = None, eos: set[int] = frozenset(), stop: list[str] | None = None,
        streamer=None) -> GenerateOutput:
    """Decode up to ``max_new_tokens`` after ``prompt`` [1, T] (see ``check_inputs``) with ``drafter``.

    Stops after an ``eos`` token (kept) or a ``stop`` string; ``streamer`` (a transformers streamer)
    gets the prompt, then the tokens of each step as they are accepted."""
    stats = DecodeStats()
    prompt = prompt.to(target.device)
    if max_new_tokens == 0:
        return GenerateOutput(prompt.clone(), stats)
    _stream(streamer, prompt.cpu())
    clock = Stopwatch(target.device)  # the caller's queued kernels are not this prefill's
    decoder = Decoder(target, drafter, sampling, generator)
    root = decoder.prefill(prompt)
    new, done = finish([root], max_new_tokens, eos, stop, target.tokenizer)
    _stream(streamer, torch.tensor(new))
    stats.prefill_s = clock.lap()
    while not done:
        step = decoder.step(root, max_depth=max_new_tokens - len(new) - 1)
        before = len(new)
        new, done = finish(new + step.emitted, max_new_tokens, eos, stop, target.tokenizer)
        stats.record(step.tree, step.path, len(new) - before, step.draft_s, step.verify_s)
        if len(new) > before:
            _stream(streamer, torch.tensor(new[before:]))
        root = step.next_token
    stats.total_s = clock.elapsed()
    stats.new_tokens = len(new)
    if streamer is not None:
        streamer.end()
    return GenerateOutput(torch.cat([prompt, torch.tensor([new], device=prompt.device)], dim=1), stats)


def _stream(streamer, tokens: torch.Tensor) -> None:
    if streamer is not None:
        streamer.put(tokens)


def check_inputs(target, input_ids: torch.Tensor, max_new_tokens: int) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [1, T], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"one sequence: input_ids must be [1, T], got {input_ids.shape[0]} rows (a batch runs "
                         "in batch.run_batch; decode.generate dispatches it)")
    if input_ids.shape[1] == 0:
        raise ValueError("empty prompt: pass at least one token (e.g. the BOS token or a chat template)")
    check_context(target, input_ids.shape[1], max_new_tokens)


def check_context(target, prompt_len: int, max_new_tokens: int) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ctx = getattr(target.config, "max_position_embeddings", None)
    if ctx and prompt_len + max_new_tokens > ctx:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"the target's context of {ctx} tokens (max_position_embeddings)")


def eos_ids(target, eos_token_id) -> set[int]:
    """``eos_token_id`` (an id, a list, None = the model's generation config, False = none) as a set."""
    if eos_token_id is None:
        eos_token_id = getattr(target.model.generation_config, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = target.tokenizer.eos_token_id
    if eos_token_id is None or eos_token_id is False:
        return set()
    many = isinstance(eos_token_id, (list, tuple, set))
    return {int(e) for e in (eos_token_id if many else [eos_token_id])}


def finish(new: list[int], max_new: int, eos: set, stop, tokenizer) -> tuple[list[int], bool]:
    """Truncate at the first EOS (kept, as transformers does), a stop string or max_new tokens."""
    done = len(new) >= max_new
    new = new[:max_new]
    for i, t in enumerate(new):
        if t in eos:
            return new[: i + 1], True
    if stop:
        text = tokenizer.decode(new)
        if any(s in text for s in stop):
            for i in range(1, len(new) + 1):
                if any(s in tokenizer.decode(new[:i]) for s in stop):
                    return new[:i], True
    return new, done
