"""Batched decoding: several prompts, one target forward per step for all live rows, each row with its own
drafter and its own acceptance. Lossless per row: each row gets what it would get alone.

The target's cache (a ``DynamicCache``, ``[B, heads, S, dim]``) keeps rows ragged with *masked slots*:
row b's text is in slots ``[start_b, length_b)``, where ``start_b`` is its left padding. A verify
forward appends 1 + N tokens per row at slots S.. (the root and the row's tree, padded with dummy
nodes to the batch's largest tree); its 4D mask lets row b see its own slots and the ancestors of each
node, its positions count from ``length_b - start_b``. Then ``kv.keep_rows`` copies each row's root and
accepted nodes to slots ``length_b``.., and the cache is cut to the longest row; slots beyond a
shorter row's length hold stale entries its masks never read. A finished row leaves the batch
(``kv.select_rows``; no forward is spent on it) and the leading pad slots all remaining rows share are
cut off then.

Drafting is per row: each row's drafter (``Drafter.fork``) drafts its own tree and reads its row of the
verify forward (``row_output``). For an EAGLE head the first head forward of each draft (the accepted
tokens' catch-up, all of drafting for a depth-1 tree) runs for all rows at once
(``drafters.catch_up_rows``); the deeper levels of the tree run row by row.
"""
from __future__ import annotations

from dataclasses import fields, replace

import torch

from eaglekit.decode import kv
from eaglekit.decode.drafters import catch_up_rows
from eaglekit.decode.loop import GenerateOutput, Step, finish
from eaglekit.decode.sampling import Sampling, sample
from eaglekit.decode.stats import BatchStats, DecodeStats
from eaglekit.decode.tree import fetch
from eaglekit.decode.verify import accept, accepted_rows, layer_masks, verify_batch
from eaglekit.timing import Stopwatch


def row_output(out, b: int, begin: int, end: int):
    """Row b of a batched ``TargetOutput``, sequence positions [begin, end) of every per-token tensor: what
    a row's drafter reads. Logits kept for the last L positions only (``logits_to_keep``) are cut where
    they overlap [begin, end)."""
    seq = out.last.shape[1]
    cut = {}
    for f in fields(out):
        v = getattr(out, f.name)
        if isinstance(v, torch.Tensor):
            skip = seq - v.shape[1]  # positions before the first one kept
            cut[f.name] = v[b:b + 1, max(begin - skip, 0):max(end - skip, 0)]
    return replace(out, past_key_values=None, **cut)


def pad_prompts(input_ids, attention_mask, pad_id: int) -> tuple[torch.Tensor, list[int]]:
    """``input_ids`` as a left-padded [B, T] tensor and each row's left padding. Takes a list of 1-D
    prompts (padded here with ``pad_id``) or a [B, T] tensor with ``attention_mask`` (1 on tokens, 0 on
    the left pads; None = no padding)."""
    if isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("a list of prompts is padded by generate: pass no attention_mask with it")
        rows = [torch.as_tensor(p, dtype=torch.long).flatten() for p in input_ids]
        if not rows:
            raise ValueError("empty list of prompts")
        for b, r in enumerate(rows):
            if r.numel() == 0:
                raise ValueError(f"prompt {b} is empty: pass at least one token (e.g. the BOS token)")
        width = max(len(r) for r in rows)
        ids = torch.stack([torch.cat([r.new_full((width - len(r),), pad_id), r]) for r in rows])
        return ids, [width - len(r) for r in rows]
    ids = torch.as_tensor(input_ids)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T] or a list of 1-D prompts, got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("empty prompt: pass at least one token (e.g. the BOS token or a chat template)")
    if attention_mask is None:
        return ids, [0] * ids.shape[0]
    mask = torch.as_tensor(attention_mask).to(ids.device)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} must have input_ids' shape {tuple(ids.shape)}")
    starts = []
    for b, row in enumerate(mask.long().cpu().tolist()):
        n = len(row) - sum(row)
        if any(x not in (0, 1) for x in row) or row != [0] * n + [1] * (len(row) - n):
            hint = ("it is right-padded: tokenize with tokenizer.padding_side = 'left', or pass a list of 1-D "
                    "prompts" if row == [1] * (len(row) - n) + [0] * n else f"got {_short(row)}")
            raise ValueError(f"attention_mask row {b} must be 0 on left pads then 1 on the prompt (left "
                             f"padding): {hint}")
        if n == len(row):
            raise ValueError(f"attention_mask row {b} is all 0: an empty prompt")
        starts.append(n)
    return ids, starts


def _short(row: list, keep: int = 12) -> str:
    """A mask row for an error message: whole if short, else its ends."""
    if len(row) <= 2 * keep:
        return str(row)
    return f"[{', '.join(map(str, row[:keep]))}, ... ({len(row) - 2 * keep} more), {', '.join(map(str, row[-keep:]))}]"


class BatchDecoder:
    """The decoding state of a batch: the target's cache with each row's slots, one drafter per row.

    ``prefill(ids, starts)`` once, then ``step(roots, max_depths)`` per target forward and ``keep(rows)``
    when rows leave. Decoder row i is whichever prompt the caller maps it to; ``keep`` renumbers them."""

    def __init__(self, target, drafters: list, sampling: Sampling, generator: torch.Generator | None = None):
        self.target, self.drafters, self.sampling, self.generator = target, list(drafters), sampling, generator
        self.kind, self.layer_ids = drafters[0].kind, drafters[0].layer_ids
        self.cache = kv.new_cache(target.model)

    def prefill(self, ids: torch.Tensor, starts: list[int]) -> list[int]:
        """Run the left-padded prompts ``ids`` [B, T] into the cache; returns each row's first new token."""
        B, T = ids.shape
        self.starts, self.lengths = list(starts), [T] * B
        s = torch.tensor(starts)[:, None, None]
        i, j = torch.arange(T)[None, :, None], torch.arange(T)[None, None, :]
        # a pad row sees itself only (finite, never read); a prompt row its own prompt, causally
        allowed = ((j <= i) & (j >= s)) | ((i < s) & (i == j))
        dev = self.target.device
        pos = (torch.arange(T)[None] - torch.tensor(starts)[:, None]).clamp_min(0)
        out = self.target.forward(ids.to(dev), attention_mask=layer_masks(self.target, allowed, pos, pos),
                                  position_ids=pos.to(dev), past_key_values=self.cache, kind=self.kind,
                                  layer_ids=self.layer_ids, logits_to_keep=1)
        roots = []
        for b, drafter in enumerate(self.drafters):
            last = out.logits[b, -1]
            roots.append(int(last.argmax()) if self.sampling.greedy else sample(self.sampling.probs(last),
                                                                                 self.generator))
            drafter.prefill(ids[b:b + 1, starts[b]:].to(dev), row_output(out, b, starts[b], T), roots[-1])
        return roots

    def step(self, roots: list[int], max_depths: list[int]) -> tuple[list[Step], float, float]:
        """Each row drafts, one verify forward for all, each row accepts, keeps and commits. Returns the
        rows' ``Step`` and the batch's seconds drafting and verifying (verify, acceptance, keep, commits)."""
        clock = Stopwatch(self.target.device)
        catch_up_rows(self.drafters)  # heads: every row's accepted tokens in one head forward
        trees = [d.draft(m) for d, m in zip(self.drafters, max_depths)]
        draft_s = clock.lap()
        out, past = verify_batch(self.target, self.cache, roots, trees, self.starts, self.lengths, self)
        # one read from the device for the whole batch: every tree's nodes and (greedy) every row's argmax
        best = fetch(trees, out.logits.argmax(-1) if self.sampling.greedy else None)
        steps = []
        for b, tree in enumerate(trees):
            path, next_token = accept(out.logits[b, :1 + len(tree)], tree, self.sampling, self.generator,
                                      argmax=None if best is None else best[b])
            steps.append(Step(tree, path, next_token))
        rows = [accepted_rows(s.path) for s in steps]
        self.lengths = kv.keep_rows(self.cache, past, self.lengths, rows)
        for b, (drafter, s) in enumerate(zip(self.drafters, steps)):
            drafter.commit(s.tree, s.path, s.next_token, row_output(out, b, 0, 1 + len(s.tree)), rows[b])
        return steps, draft_s, clock.lap()

    def keep(self, rows: list[int]) -> None:
        """Keep decoder rows ``rows`` (in that order) and drop the others; cut the slots no kept row uses."""
        start, end = min(self.starts[b] for b in rows), max(self.lengths[b] for b in rows)
        kv.select_rows(self.cache, rows, start, end)
        self.starts = [self.starts[b] - start for b in rows]
        self.lengths = [self.lengths[b] - start for b in rows]
        self.drafters = [self.drafters[b] for b in rows]


@torch.no_grad()
def run_batch(target, drafters: list, ids: torch.Tensor, starts: list[int], max_new_tokens: int,
              sampling: Sampling, generator: torch.Generator | None = None, eos: set[int] = frozenset(),
              stop: list[str] | None = None, pad_id: int = 0) -> GenerateOutput:
    """Decode up to ``max_new_tokens`` after each row of the left-padded ``ids`` [B, T] (row b starts at
    ``starts[b]``), row b drafted by ``drafters[b]``. Returns ``sequences`` [B, T + max_new_tokens]: the
    input, then row b's new tokens, then ``pad_id`` after the row ended (at an ``eos`` token, kept, a
    ``stop`` string or ``max_new_tokens``); ``stats`` a ``BatchStats``."""
    B, T = ids.shape
    ids = ids.to(target.device)
    stats = BatchStats(rows=[DecodeStats() for _ in range(B)])
    new: list[list[int]] = [[] for _ in range(B)]
    if max_new_tokens > 0:
        clock = Stopwatch(target.device)
        decoder = BatchDecoder(target, drafters, sampling, generator)
        roots = decoder.prefill(ids, starts)
        live = []  # the prompt of each decoder row
        for b in range(B):
            new[b], done = finish([roots[b]], max_new_tokens, eos, stop, target.tokenizer)
            if not done:
                live.append(b)
        stats.prefill_s = clock.lap()
        if len(live) < B and live:
            decoder.keep(live)
        while live:
            steps, draft_s, verify_s = decoder.step([roots[b] for b in live],
                                                    [max_new_tokens - len(new[b]) - 1 for b in live])
            kept = []
            for i, (b, step) in enumerate(zip(live, steps)):
                before = len(new[b])
                new[b], done = finish(new[b] + step.emitted, max_new_tokens, eos, stop, target.tokenizer)
                stats.rows[b].record(step.tree, step.path, len(new[b]) - before)
                roots[b] = step.next_token
                if not done:
                    kept.append(i)
            stats.draft_s, stats.verify_s, stats.forwards = (stats.draft_s + draft_s, stats.verify_s + verify_s,
                                                             stats.forwards + 1)
            if len(kept) < len(live):
                live = [live[i] for i in kept]
                if live:
                    decoder.keep(kept)
        stats.total_s = clock.elapsed()
    for row, tokens in zip(stats.rows, new):
        row.new_tokens = len(tokens)
        stats.pool(row)
    stats.new_tokens = sum(len(t) for t in new)
    out = torch.full((B, T + max_new_tokens), pad_id, dtype=ids.dtype, device=ids.device)
    out[:, :T] = ids
    for b, tokens in enumerate(new):
        out[b, T:T + len(tokens)] = torch.tensor(tokens, dtype=ids.dtype)
    return GenerateOutput(out, stats)
