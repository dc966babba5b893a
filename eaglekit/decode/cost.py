"""What drafting and verification cost on this device, measured: the input of ``tree="auto"`` (plan.py).

Verifying m tokens costs the target c(m): one forward over m new tokens on a cached prefix; for a batch of
B rows, one forward over B × m new tokens on B cached prefixes. One draft level of k nodes costs the head
d(k): one head step over k nodes with a tree mask, and the top-k that follows (a batch drafts row by row:
B × d(k)); a parallel head's drafting is one forward whatever the tree (``Costs.draft_s``). Each is the
median of a few runs, the sizes taken in turn on each repeat.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from itertools import pairwise

import torch

from eaglekit.decode import kv
from eaglekit.decode.proposers import HeadProposer
from eaglekit.heads import HeadCache
from eaglekit.timing import timed

# dense up to 8: on a CPU the cost is lumpy there (not monotone in the rows; see benchmarks/RESULTS.md,
# "Where the time goes on the CPU")
VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 64, 96)
LEVEL_SIZES = (1, 2, 4, 6, 8, 10)
# a batch's verify sizes: up to this many tokens in one forward (B × m), and always m <= 4
BATCH_TOKENS = {"cuda": 2048, "cpu": 256}


@dataclass
class Costs:
    device: str
    verify_s: dict  # tokens verified per row (root included) -> seconds per target forward on cached prefixes
    level_s: dict  # nodes per draft level -> seconds per head step (one row)
    batch_size: int = 1  # rows in each verify forward measured
    draft_s: float | None = None  # a parallel head: seconds of its one drafting forward per step (one row)

    def verify(self, m: int) -> float:
        return _interp(self.verify_s, m)

    def level(self, k: int) -> float:
        return _interp(self.level_s, k)

    def drafting(self, depth: int, k: int) -> float:
        """One row's drafting time for a tree ``depth`` deep and ``k`` wide: the catch-up step and
        depth - 1 levels of k nodes, or a parallel head's one forward whatever the tree."""
        if self.draft_s is not None:
            return self.draft_s
        return self.level(2) + (depth - 1) * self.level(k)


def _interp(table: dict, x: float) -> float:
    pts = sorted((int(k), float(v)) for k, v in table.items())
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in pairwise(pts):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-")
    return f"{device.type}-{platform.machine()}-{os.cpu_count()}cpu-{torch.get_num_threads()}threads"


def _medians(fns: dict, repeats: int) -> dict:
    """key -> median seconds of ``fns[key]()``, the keys taken in turn on each repeat (after one warm-up
    each): a slow spell of a shared machine then hits every size alike instead of a few in a row."""
    for fn in fns.values():
        fn()
    times = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            times[key].append(timed(fn)[1])  # every device synced: the warm-up's kernels may still run
    return {key: sorted(ts)[len(ts) // 2] for key, ts in times.items()}


@torch.no_grad()
def verify_costs(target, prefix: torch.Tensor, repeats: int = 3, sizes=VERIFY_SIZES, kind=None,
                 layer_ids=None) -> dict:
    """m -> median seconds of a target forward over m new tokens per row on the cached ``prefix`` [B, P]."""
    dev, (rows, prefix_len) = target.device, prefix.shape
    cache = kv.new_cache(target.model)
    target.forward(prefix.to(dev), past_key_values=cache, kind=None)

    def run(m):
        ids = torch.randint(10, target.vocab_size - 1, (rows, m), device=dev)

        def fn():
            target.forward(ids, past_key_values=cache, kind=kind, layer_ids=layer_ids)
            kv.crop(cache, prefix_len)
        return fn
    return _medians({m: run(m) for m in sizes}, repeats)


def batch_verify_sizes(device: torch.device, batch_size: int) -> tuple[int, ...]:
    """The tokens per row a plan measures for ``batch_size`` rows: all of ``VERIFY_SIZES`` for one row,
    else those whose B × m fits ``BATCH_TOKENS`` (a wide tree is not what a full batch wants)."""
    if batch_size == 1:
        return VERIFY_SIZES
    cap = BATCH_TOKENS.get(device.type, BATCH_TOKENS["cpu"])
    return tuple(m for m in VERIFY_SIZES if m <= 4 or batch_size * m <= cap)


@torch.no_grad()
def measure(target, head, prefix_len: int = 128, repeats: int = 5, batch_size: int = 1) -> Costs:
    """Median wall time of a target forward over m new tokens on a cached prefix (per row of a batch of
    ``batch_size``), and of a head step (one row)."""
    prefix = torch.randint(10, target.vocab_size - 1, (batch_size, prefix_len), device=target.device)
    taps = HeadProposer(target, head)  # the verify forward returns what this head reads
    verify_s = verify_costs(target, prefix, repeats, batch_verify_sizes(target.device, batch_size), kind=taps.kind,
                            layer_ids=taps.layer_ids)
    if getattr(head, "parallel", False):  # one drafting forward whatever the tree: no per-level cost
        draft_s = block_cost(head, prefix_len, repeats)
        return Costs(device_name(target.device), verify_s, dict.fromkeys(LEVEL_SIZES, draft_s), batch_size, draft_s)
    hdev, H = head.device, head.config.hidden_size
    hcache = HeadCache()
    prefix = prefix[:1]
    head.step(prefix[:, 1:].to(hdev), torch.randn(1, prefix_len - 1, H, device=hdev, dtype=head.dtype),
              torch.arange(prefix_len - 1, device=hdev)[None], cache=hcache)

    def level(k):
        ids = torch.randint(10, target.vocab_size - 1, (1, k), device=hdev)
        g = torch.randn(1, k, H, device=hdev, dtype=head.dtype)
        pos = torch.full((1, k), prefix_len, device=hdev)
        mask = torch.zeros(1, 1, k, prefix_len - 1 + k, device=hdev, dtype=head.dtype)

        def step():
            head.step(ids, g, pos, cache=hcache, attn_mask=mask)
            log = torch.log_softmax(torch.randn(k, head.config.draft_vocab_size, device=hdev), -1)
            log.topk(min(k, log.shape[-1]))
            hcache.crop(prefix_len - 1)
        return step
    level_s = _medians({k: level(k) for k in LEVEL_SIZES}, repeats)
    return Costs(device_name(target.device), verify_s, level_s, batch_size)


@torch.no_grad()
def block_cost(head, prefix_len: int, repeats: int, pending: int = 2) -> float:
    """Median seconds of a parallel head's drafting forward: ``pending`` new elements on a cached prefix
    (about what a step accepts), the whole block drafted, the cache cut back."""
    dev, H, V = head.device, head.config.hidden_size, head.config.target_vocab_size
    cache = head.new_cache()
    head.draft(cache, torch.randint(10, V - 1, (1, prefix_len), device=dev),
               torch.randn(1, prefix_len, H, device=dev, dtype=head.dtype), torch.arange(prefix_len, device=dev)[None])
    ids = torch.randint(10, V - 1, (1, pending), device=dev)
    g = torch.randn(1, pending, H, device=dev, dtype=head.dtype)
    pos = torch.arange(prefix_len, prefix_len + pending, device=dev)[None]

    def step():
        logits = head.draft(cache, ids, g, pos)
        torch.log_softmax(logits[0].float(), -1).topk(min(8, logits.shape[-1]))
        cache.crop(prefix_len)
    return _medians({0: step}, repeats)[0]
