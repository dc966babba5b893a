"""``tree="auto"``: what drafting and verification cost on this device, measured, and the tree they make best.

Verifying m tokens costs the target c(m): one forward over m new tokens on a cached prefix; for a batch of
B rows, one forward over B × m new tokens on B cached prefixes. One draft level of k nodes costs the head
d(k): one head step over k nodes with a tree mask, and the top-k that follows (a batch drafts row by row:
B × d(k)); a parallel head's drafting is one forward whatever the tree (``Costs.draft_s``). Each is the
median of a few runs, the sizes taken in turn on each repeat (``measure``, once per device, target, head
shape and dtype, cached as JSON under the eaglekit cache dir, ``decode-costs/``).

``auto_plan`` sizes the head's EAGLE-2 tree from those costs. The expected tokens per step of a tree is
1 + Σ over its nodes of the node's path probability under the head (EAGLE-2's observation: the draft's
confidence predicts acceptance), taken from a short calibration run of the head on a real prompt. The spec
maximising E[tokens] / (d(pending) + (depth-1)·d(top_k) + c(total_tokens + 1)) wins: on a CPU, where c
grows quickly, that is a small tree; on a GPU, where c stays nearly flat over dozens of tokens, a large
one. Where no tree is expected to beat plain decoding, "auto" decodes without drafting.

A parallel head (P-EAGLE: ``head.parallel``) drafts its whole tree in one forward: d is then that forward's
time whatever the tree, the tree is built from the block's per-depth top-k (``drafters.block_tree``) and
is at most ``head.draft_depths`` deep.

A batch of B rows is planned for B (``auto_plan(..., batch_size=B)``, cached per B): c is then measured
for B × m tokens, drafting costs B × d (each row drafts alone), a step emits B × E[tokens]; plain decoding
emits B tokens per forward. As B grows the forward stops being memory-bound, c(m) grows with m and the
best tree shrinks until none pays: "auto" then decodes the batch without drafting.
"""
from __future__ import annotations

import hashlib
import json
import operator
import os
import platform
import weakref
from dataclasses import asdict, dataclass, field
from itertools import pairwise

import torch

from eaglekit import __version__, assets
from eaglekit.decode import loop
from eaglekit.decode.drafters import (
    EagleDrafter,
    HeadProposer,
    ParallelDrafter,
    PlainDrafter,
    TreeSpec,
    down_paths,
)
from eaglekit.decode.loop import Sampling
from eaglekit.fileio import write_text
from eaglekit.heads import HeadCache
from eaglekit.target import crop_cache, new_cache, record_states
from eaglekit.target.packed_linear import packed_count
from eaglekit.timing import timed

# dense up to 8: on a CPU the cost is lumpy there (not monotone in the rows; see benchmarks/RESULTS.md,
# "Where the time goes")
VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 64, 96)
LEVEL_SIZES = (1, 2, 4, 6, 8, 10)
# a batch's verify sizes: up to this many tokens in one forward (B × m), and always m <= 4
BATCH_TOKENS = {"cuda": 2048, "cpu": 256}
MAX_DEPTH = 8
PLAN_FORMAT = 2  # bumped when a plan gains fields or is measured differently: cached plans are then remade
# What a prompt-lookup branch (lookup.BY_MATCH) adds on the steps that have one: rows to the verify and
# accepted tokens. Tuned on a 2-core CPU with an EAGLE-3 head on SmolLM2 (MT-bench).
BRANCH_ROWS, BRANCH_TOKENS = 3, 0.8


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
def verify_costs(target, prefix: torch.Tensor, repeats: int = 3, sizes=VERIFY_SIZES, layer_ids=()) -> dict:
    """m -> median seconds of a target forward over m new tokens per row on the cached ``prefix`` [B, P],
    tapping ``layer_ids`` (what a head reads; () none). On a target that decodes on its model's own cache
    (``own_cache``: recurrent layers) each forward records its states per position and is cropped back, as a
    drafted step's is: what the state handling costs is in c(m)."""
    dev, (rows, prefix_len) = target.device, prefix.shape
    own = getattr(target, "own_cache", False)
    cache = None if own else new_cache(target.model)
    out = target.forward(prefix.to(dev), past_key_values=cache, layer_ids=(), use_cache=True)
    cache = out.past_key_values if own else cache

    def run(m):
        ids = torch.randint(10, target.vocab_size - 1, (rows, m), device=dev)

        def fn():
            if own:
                record_states(cache, m)
            target.forward(ids, past_key_values=cache, layer_ids=layer_ids, use_cache=True)
            cache.crop(-m) if own else crop_cache(cache, prefix_len)
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
    sizes = batch_verify_sizes(target.device, batch_size)
    if getattr(target, "own_cache", False):  # chains only (``planned_widths``): a root and at most MAX_DEPTH nodes
        sizes = tuple(m for m in sizes if m <= MAX_DEPTH + 1)
    verify_s = verify_costs(target, prefix, repeats, sizes, layer_ids=taps.layer_ids)
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


# ---- the plan: the best tree for a head from these costs -------------------------------------------

@dataclass(frozen=True)
class Plan:
    """The best tree for a head on this device, and what it is expected to be worth."""

    spec: TreeSpec
    expected_tokens_per_s: float
    plain_tokens_per_s: float  # one target forward per token
    nodes_with_lookup: int | None = None  # the head's nodes kept on a step that has a lookup branch
    costs: dict = field(default_factory=dict)  # the measured ``cost.Costs``, as JSON
    batch_size: int = 1  # rows decoded together (the tokens per second are the batch's)

    @property
    def drafting_pays(self) -> bool:
        """Whether the best tree is expected to beat plain decoding."""
        return self.expected_tokens_per_s > self.plain_tokens_per_s

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        return cls(**{**data, "spec": TreeSpec(**data["spec"])})


def _max_depth(head) -> int:
    """The deepest tree a plan considers: a parallel head proposes ``draft_depths`` tokens at most."""
    return min(MAX_DEPTH, head.draft_depths) if getattr(head, "parallel", False) else MAX_DEPTH


@torch.no_grad()
def calibrate(target, head, ids: torch.Tensor, contexts: int = 4, depth: int = MAX_DEPTH,
              ks=LEVEL_SIZES) -> dict:
    """Per top_k: for each calibration context, every pool node's (depth, path probability)."""
    taps = HeadProposer(target, head)  # what the head reads of the target
    out = target.forward(ids, layer_ids=taps.layer_ids, logits=False)
    L = ids.shape[1]
    cuts = [int(L * (i + 1) / (contexts + 1)) for i in range(contexts)]
    make, depth = (ParallelDrafter if getattr(head, "parallel", False) else EagleDrafter), min(depth, _max_depth(head))
    pools = {}
    for k in ks:
        pools[k] = []
        for j in cuts:
            dr = make(target, head, TreeSpec(depth, k, total_tokens=k + (depth - 1) * k * k))
            dr.prefill(ids[:, :j], out, int(ids[0, j]))  # the head reads the features of the first j rows
            tree = dr.draft(max_depth=depth)
            _, parents, depths = tree.host()
            pools[k].append((depths, down_paths(tree.q_token.double().tolist(), parents, operator.mul)))
    return pools


def expected_tokens(pool, depth: int, n: int) -> float:
    """1 + the n largest path probabilities among nodes at depth <= ``depth``, averaged over contexts."""
    total = 0.0
    for depths, probs in pool:
        ps = sorted((p for d, p in zip(depths, probs) if d <= depth), reverse=True)[:n]
        total += 1.0 + sum(ps)
    return total / max(len(pool), 1)


def choose(costs: Costs, pools: dict, max_total: int = 96, max_depth: int = MAX_DEPTH) -> tuple[TreeSpec, float]:
    """The spec with the most expected tokens per second (the batch's, for ``costs.batch_size`` rows each
    drafting alone and verified in one forward), at most ``max_depth`` deep; returns (spec, tokens/s)."""
    rows = costs.batch_size
    best, best_rate = TreeSpec(1, 1, 1), 0.0
    for k, pool in pools.items():
        k = int(k)
        for d in range(1, max_depth + 1):
            size = k + (d - 1) * k * k
            for n in sorted({1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64, 80, 96}):
                if n > min(size, max_total):
                    continue
                step = rows * costs.drafting(d, k) + costs.verify(n + 1)
                rate = rows * expected_tokens(pool, d, n) / step
                if rate > best_rate * (1 + 1e-9):
                    best, best_rate = TreeSpec(d, k, n), rate
    return best, best_rate


def nodes_beside_branch(costs: Costs, pool, spec: TreeSpec, rows: int = BRANCH_ROWS,
                        tokens: float = BRANCH_TOKENS) -> int:
    """How many of ``spec``'s best nodes to keep on a step that also verifies a branch of ``rows`` nodes
    worth ``tokens`` accepted tokens: the most expected tokens per second (ties: fewer nodes)."""
    def rate(n):
        draft = costs.batch_size * costs.drafting(spec.depth, spec.top_k)
        return (expected_tokens(pool, spec.depth, n) + tokens) / (draft + costs.verify(n + 1 + rows))
    return max(range(spec.total_tokens + 1), key=rate)


def calibration_ids(target, n_new: int = 48) -> torch.Tensor:
    """An MT-bench question in the chat template plus the target's own greedy answer."""
    q = assets.load_mt_bench()[1]["turns"][0]
    return loop.run(target, PlainDrafter(), target.chat_ids(q), n_new, Sampling()).sequences


def _key(target, head, batch_size: int = 1) -> str:
    with torch.no_grad():
        w = float(sum(p.double().abs().sum() for p in head.parameters()))
    blob = json.dumps([device_name(target.device), str(target.dtype), target.fingerprint(),
                       head.config.kind, head.config.num_layers, head.config.draft_vocab_size, round(w, 3),
                       __version__, packed_count(target.model), packed_count(head), VERIFY_SIZES, PLAN_FORMAT]
                      + ([batch_size] if batch_size > 1 else [])  # one row: the key plans had before batches
                      + ([head.config.block_size] if getattr(head, "parallel", False) else []))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# head -> {batch size: (what the plan was made for, plan)}: generate(tree="auto") called per prompt would
# otherwise hash the head's weights on every call. Parameters are compared by identity and in-place
# version. _POOLS: head -> (made for, calibration pools), shared by the plans for every batch size.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _made_for(target, head, cache_dir) -> tuple:
    return (id(target.model), target.fingerprint(), str(target.device), str(target.dtype), str(cache_dir),
            packed_count(target.model), packed_count(head), tuple((id(p), p._version) for p in head.parameters()))


def auto_plan(target, head, cache_dir=None, refresh: bool = False, batch_size: int = 1) -> Plan:
    """Measure (or read the cached) costs and calibration: the best tree for ``head`` on this device, for
    ``batch_size`` rows decoded together."""
    made_for = _made_for(target, head, cache_dir)
    plans = _PLANS.setdefault(head, {})
    if not refresh and batch_size in plans and plans[batch_size][0] == made_for:
        return plans[batch_size][1]
    plan = _load_or_measure(target, head, cache_dir, refresh, batch_size)
    plans[batch_size] = made_for, plan
    return plan


def planned_widths(target) -> tuple[int, ...]:
    """The top_k a plan considers: every ``LEVEL_SIZES`` on eaglekit's cache; on a model's own cache (recurrent
    layers) chains only, since a tree is verified one row per root-to-leaf path there (``loop.verify_paths``: L
    leaves cost L x (1 + depth) positions, not the tree's nodes, so c(n) does not price it)."""
    return (1,) if getattr(target, "own_cache", False) else LEVEL_SIZES


def _pools(target, head):
    made_for = _made_for(target, head, None)
    if head not in _POOLS or _POOLS[head][0] != made_for:
        _POOLS[head] = made_for, calibrate(target, head, calibration_ids(target), ks=planned_widths(target))
    return _POOLS[head][1]


def _load_or_measure(target, head, cache_dir, refresh: bool, batch_size: int = 1) -> Plan:
    path = (cache_dir or assets.cache_dir() / "decode-costs") / f"{_key(target, head, batch_size)}.json"
    if path.exists() and not refresh:
        return Plan.from_json(json.loads(path.read_text()))
    costs = measure(target, head, batch_size=batch_size)
    pools = _pools(target, head)
    # a batch: no wider tree than measured (m × B past the measured sizes would be an extrapolation)
    spec, rate = choose(costs, pools, max_total=96 if batch_size == 1 else max(map(int, costs.verify_s)) - 1,
                        max_depth=_max_depth(head))
    plan = Plan(spec, rate, plain_tokens_per_s=batch_size / costs.verify(1), costs=asdict(costs),
                nodes_with_lookup=nodes_beside_branch(costs, pools[spec.top_k], spec), batch_size=batch_size)
    text = json.dumps(plan.to_json(), indent=1)
    write_text(path, text)
    return Plan.from_json(json.loads(text))  # as a later read of the file gives it (costs keyed by strings)
