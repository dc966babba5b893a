"""Batches for training: length-bucketed micro-batches, sharded across ranks, right-padded.

The plan of micro-batches depends only on (lengths, batch settings, seed, epoch), never on the number
of processes: optimizer step s consumes micro-batches ``[s*M, (s+1)*M)`` of the plan (M = world x
grad_accum), and rank r takes every world-th of them. So one process with ``grad_accum=2`` and two
processes with ``grad_accum=1`` see the same samples per step, and a resumed run regenerates the plan
from (epoch, step) alone.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch


def plan_micro_batches(lengths: list[int], batch_size: int, max_tokens: int = 0, pool: int = 64,
                       seed: int = 0, epoch: int = 0) -> list[list[int]]:
    """Shuffle, sort by length inside pools of ``pool`` micro-batches, cut, then shuffle the batches.

    Sorting within a pool keeps padding small while the pool shuffle keeps batches varied. A micro-batch
    holds at most ``batch_size`` samples and, if ``max_tokens`` > 0, at most ``max_tokens`` padded tokens.
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    span = max(1, pool * batch_size)
    batches: list[list[int]] = []
    for start in range(0, len(order), span):
        chunk = sorted(order[start:start + span], key=lambda i: lengths[i])
        cur: list[int] = []
        for i in chunk:
            longest = max([lengths[j] for j in cur] + [lengths[i]])
            if cur and (len(cur) >= batch_size or (max_tokens and longest * (len(cur) + 1) > max_tokens)):
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


@dataclass
class Schedule:
    """Which micro-batches this rank runs at each optimizer step of one epoch."""
    plan: list[list[int]]
    world: int
    rank: int
    accum: int

    @property
    def steps(self) -> int:  # whole optimizer steps only, so every rank runs the same number
        return len(self.plan) // (self.world * self.accum)

    def global_step(self, step: int) -> list[list[int]]:
        per = self.world * self.accum
        return self.plan[step * per:(step + 1) * per]

    def local_step(self, step: int) -> list[list[int]]:
        return self.global_step(step)[self.rank::self.world]


def epoch_schedule(cfg, lengths: list[int], world: int, rank: int, epoch: int) -> Schedule:
    """This rank's micro-batches per optimizer step of ``epoch`` (``cfg``: a TrainConfig)."""
    d = cfg.data
    plan = plan_micro_batches(lengths, d.batch_size, d.max_tokens, d.bucket_pool, cfg.seed, epoch)
    return Schedule(plan, world, rank, cfg.optim.grad_accum)


def plan_steps(cfg, lengths: list[int], world: int, where: str) -> tuple[int, list[int]]:
    """(optimizer steps of the run, steps per epoch); refuses data that makes no whole step."""
    o = cfg.optim
    per_epoch = [epoch_schedule(cfg, lengths, world, 0, e).steps for e in range(max(1, o.epochs))]
    if per_epoch[0] == 0:
        raise ValueError(f"{where}: {len(lengths)} training samples make no whole optimizer step (batch "
                         f"{cfg.data.batch_size} x grad_accum {o.grad_accum} x {world} processes)")
    return o.max_steps or sum(per_epoch), per_epoch


def collate(items: list[dict], reads: str = "taps") -> dict:
    """Right-pad item dicts into a batch: input_ids, loss_mask (0 on padding), last, the tensor the head
    reads (``head.reads``: ``taps`` or ``last`` itself) and, when every item has it, top.

    Right padding under a causal mask leaves every real position's result unchanged. ``origin`` (when
    every item has one) lists, row by row, where each sequence came from (a list of str, not a tensor).
    """
    width = max(len(it["input_ids"]) for it in items)
    B = len(items)
    ids = torch.zeros(B, width, dtype=torch.long)
    mask = torch.zeros(B, width, dtype=torch.long)
    features = {key: items[0][key].new_zeros(B, width, items[0][key].shape[-1]) for key in dict.fromkeys(("last", reads))}
    top = torch.full((B, width), -1, dtype=torch.long) if all("top" in it for it in items) else None
    for b, it in enumerate(items):
        n = len(it["input_ids"])
        ids[b, :n] = torch.as_tensor(it["input_ids"]).long()
        mask[b, :n] = torch.as_tensor(it["loss_mask"]).long()
        for key, padded in features.items():
            padded[b, :n] = it[key]
        if top is not None:
            top[b, :n] = it["top"]
    out = {"input_ids": ids, "loss_mask": mask, **features}
    if top is not None:
        out["top"] = top
    if all("origin" in it for it in items):
        out["origin"] = [str(it["origin"]) for it in items]
    return out


def fetch_with_top(source, indices, teacher, chunk: int, device) -> list[dict]:
    """Items at ``indices`` with the teacher's full-vocab argmax memoised in each (``top``: kept when the
    source caches its items, so later epochs skip it)."""
    items = fetch(source, indices)
    for it in items:
        if "top" not in it:
            last = it["last"].to(device)
            it["top"] = teacher.targets(last[None], chunk)[0].cpu()
    return items


def tensors_to(batch: dict, device) -> dict:
    """The batch's tensors on ``device`` (``origin``, a list of names, stays behind)."""
    return to_device({k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}, device)


def to_device(batch: dict, device, dtype=None) -> dict:
    """Tensors moved (floating ones cast to ``dtype``); anything else (``origin``) passed through as is."""
    out = {}
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor):
            out[k] = v
            continue
        v = v.to(device)
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        out[k] = v
    return out


class Subset:
    """A view of ``source`` at ``indices`` keeping ``lengths`` (for bucketing)."""

    def __init__(self, source, indices: list[int], lengths: list[int]):
        self.source, self.indices = source, list(indices)
        self.lengths = [lengths[i] for i in self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        return self.source[self.indices[i]]

    def batch(self, indices) -> list[dict]:
        return fetch(self.source, [self.indices[i] for i in indices])


class CachedItems:
    """Keep computed items (online features) in RAM so later epochs skip the target forward."""

    def __init__(self, source):
        self.source, self.lengths = source, list(source.lengths)
        self._items: dict[int, dict] = {}

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict:
        return self.batch([i])[0]

    def batch(self, indices) -> list[dict]:
        missing = [i for i in dict.fromkeys(indices) if i not in self._items]
        if missing:
            self._items.update(zip(missing, fetch(self.source, missing)))
        return [self._items[i] for i in indices]


class KnownTops:
    """``source`` with each item's teacher argmax (``top``, draft ids) added from RAM: computed once ahead,
    when the lm_head that gives it is not kept (``build.keep_target_rows``)."""

    def __init__(self, source, tops: dict[int, torch.Tensor]):
        self.source, self.tops = source, tops

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict:
        return self.batch([i])[0]

    def batch(self, indices) -> list[dict]:
        return [{**it, "top": self.tops[i]} for i, it in zip(indices, fetch(self.source, indices))]


def fetch(source, indices) -> list[dict]:
    """Items at ``indices``; a source with ``batch`` (OnlineFeatures) computes them in one padded forward."""
    if hasattr(source, "batch"):
        return source.batch(list(indices))
    return [source[i] for i in indices]


def split_eval(source, lengths: list[int], eval_samples: int) -> tuple[Subset, Subset]:
    """The last ``eval_samples`` samples are held out (deterministic, independent of the seed)."""
    n = len(lengths)
    if eval_samples >= n:
        raise ValueError(f"data.eval_samples={eval_samples} leaves no training data (the source has {n} samples)")
    cut = n - eval_samples
    return Subset(source, range(cut), lengths), Subset(source, range(cut, n), lengths)
