"""``tree="auto"``: size the EAGLE-2 tree from what verification and drafting cost on this device.

Verifying m tokens costs the target c(m); one draft level of k nodes costs the head d(k). Both are
measured here once per (device, target, head shape, dtype) and cached as JSON under the eaglekit cache
dir (``decode-costs/``). The expected tokens per step of a tree is 1 + Σ over its nodes of the node's path
probability under the head (EAGLE-2's observation: the draft's confidence predicts acceptance), taken
from a short calibration run of the head on a real prompt. The spec maximising
E[tokens] / (d(pending) + (depth-1)·d(top_k) + c(total_tokens + 1)) wins: on a CPU, where c grows
quickly, that is a small tree; on a GPU, where c is almost flat up to ~64 tokens, a large one.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
import weakref
from dataclasses import asdict, dataclass

import torch

from eaglekit.decode import kv
from eaglekit.decode.tree import TreeSpec

# dense up to 8: on a CPU the cost is lumpy there (SmolLM2, 2 cores: 2 rows cost ~20% more than 3 to 6)
VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 64, 96)
LEVEL_SIZES = (1, 2, 4, 6, 8, 10)
MAX_DEPTH = 8
PLAN_FORMAT = 2  # bumped when a plan gains fields or is measured differently: cached plans are then remade


@dataclass
class Costs:
    device: str
    verify_s: dict  # tokens verified (root included) -> seconds per target forward on a cached prefix
    level_s: dict  # nodes per draft level -> seconds per head step

    def verify(self, m: int) -> float:
        return _interp(self.verify_s, m)

    def level(self, k: int) -> float:
        return _interp(self.level_s, k)


def _interp(table: dict, x: float) -> float:
    pts = sorted((int(k), float(v)) for k, v in table.items())
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-")
    return f"{device.type}-{platform.machine()}-{os.cpu_count()}cpu-{torch.get_num_threads()}threads"


def _timed(fn) -> float:
    if torch.cuda.is_available():  # start from an idle device (the warm-up's kernels may still run)
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _medians(fns: dict, repeats: int) -> dict:
    """key -> median seconds of ``fns[key]()``, the keys taken in turn on each repeat (after one warm-up
    each): a slow spell of a shared machine then hits every size alike instead of a few in a row."""
    for fn in fns.values():
        fn()
    times = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            times[key].append(_timed(fn))
    return {key: sorted(ts)[len(ts) // 2] for key, ts in times.items()}


@torch.no_grad()
def verify_costs(target, prefix: torch.Tensor, repeats: int = 3, sizes=VERIFY_SIZES, kind=None,
                 layer_ids=None) -> dict:
    """m -> median seconds of a target forward over m new tokens on the cached ``prefix`` [1, P]."""
    dev, prefix_len = target.device, prefix.shape[1]
    cache = kv.new_cache(target.model)
    target.forward(prefix.to(dev), past_key_values=cache, kind=None)

    def run(m):
        ids = torch.randint(10, target.vocab_size - 1, (1, m), device=dev)

        def fn():
            target.forward(ids, past_key_values=cache, kind=kind, layer_ids=layer_ids)
            kv.crop(cache, prefix_len)
        return fn
    return _medians({m: run(m) for m in sizes}, repeats)


@torch.no_grad()
def measure(target, head, prefix_len: int = 128, repeats: int = 5) -> Costs:
    """Median wall time of a target forward over m new tokens on a cached prefix, and of a head step."""
    from eaglekit.heads import HeadCache

    prefix = torch.randint(10, target.vocab_size - 1, (1, prefix_len), device=target.device)
    verify_s = verify_costs(target, prefix, repeats, kind=head.config.kind,
                            layer_ids=tuple(head.config.aux_layer_ids) or None)
    hdev, H = head.device, head.config.hidden_size
    hcache = HeadCache()
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
    return Costs(device_name(target.device), verify_s, level_s)


@torch.no_grad()
def calibrate(target, head, ids: torch.Tensor, contexts: int = 4, depth: int = MAX_DEPTH,
              ks=LEVEL_SIZES) -> dict:
    """Per top_k: for each calibration context, every pool node's (depth, path probability)."""
    from eaglekit.decode.drafters import EagleDrafter
    from eaglekit.target import TargetOutput

    kind, layer_ids = head.config.kind, tuple(head.config.aux_layer_ids) or None
    out = target.forward(ids, kind=kind, layer_ids=layer_ids, logits=False)
    L = ids.shape[1]
    cuts = [int(L * (i + 1) / (contexts + 1)) for i in range(contexts)]
    pools = {}
    for k in ks:
        pools[k] = []
        for j in cuts:
            dr = EagleDrafter(target, head, TreeSpec(depth, k, total_tokens=k + (depth - 1) * k * k))
            sliced = TargetOutput(None, out.last[:, :j], None if out.aux is None else out.aux[:, :j])
            dr.prefill(ids[:, :j], sliced, int(ids[0, j]))
            tree = dr.draft(max_depth=depth)
            path_p = tree.q_token.double().clone()
            for i, p in enumerate(tree.parents.tolist()):  # parents come first
                if p >= 0:
                    path_p[i] *= path_p[p]
            pools[k].append((tree.depths.tolist(), path_p.tolist()))
    return pools


def expected_tokens(pool, depth: int, n: int) -> float:
    """1 + the n largest path probabilities among nodes at depth <= ``depth``, averaged over contexts."""
    total = 0.0
    for depths, probs in pool:
        ps = sorted((p for d, p in zip(depths, probs) if d <= depth), reverse=True)[:n]
        total += 1.0 + sum(ps)
    return total / max(len(pool), 1)


def choose(costs: Costs, pools: dict, max_total: int = 96) -> tuple[TreeSpec, float]:
    """The spec with the most expected tokens per second; returns (spec, expected tokens/s)."""
    best, best_rate = TreeSpec(1, 1, 1), 0.0
    for k, pool in pools.items():
        k = int(k)
        for d in range(1, MAX_DEPTH + 1):
            size = k + (d - 1) * k * k
            for n in sorted({1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64, 80, 96}):
                if n > min(size, max_total):
                    continue
                step = costs.level(2) + (d - 1) * costs.level(k) + costs.verify(n + 1)
                rate = expected_tokens(pool, d, n) / step
                if rate > best_rate * (1 + 1e-9):
                    best, best_rate = TreeSpec(d, k, n), rate
    return best, best_rate


# A prompt-lookup branch (lookup.BY_MATCH) on MT-bench with an EAGLE-3 head on SmolLM2: on the steps that
# have one, it added ~3 rows to the verify and ~0.8 accepted tokens (1-gram matches 0.35, 3-gram ~3.5).
BRANCH_ROWS, BRANCH_TOKENS = 3, 0.8


def nodes_beside_branch(costs: Costs, pool, spec: TreeSpec, rows: int = BRANCH_ROWS,
                        tokens: float = BRANCH_TOKENS) -> int:
    """How many of ``spec``'s best nodes to keep on a step that also verifies a branch of ``rows`` nodes
    worth ``tokens`` accepted tokens: the most expected tokens per second (ties: fewer nodes)."""
    def rate(n):
        step = costs.level(2) + (spec.depth - 1) * costs.level(spec.top_k) + costs.verify(n + 1 + rows)
        return (expected_tokens(pool, spec.depth, n) + tokens) / step
    return max(range(spec.total_tokens + 1), key=rate)


def _key(target, head) -> str:
    from eaglekit import __version__
    from eaglekit.packed_linear import packed_count

    with torch.no_grad():
        w = float(sum(p.double().abs().sum() for p in head.parameters()))
    blob = json.dumps([device_name(target.device), str(target.dtype), target.fingerprint(),
                       head.config.kind, head.config.num_layers, head.config.draft_vocab_size, round(w, 3),
                       __version__, packed_count(target.model), packed_count(head), VERIFY_SIZES, PLAN_FORMAT])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def calibration_ids(target, n_new: int = 48) -> torch.Tensor:
    """An MT-bench question in the chat template plus the target's own greedy answer."""
    from eaglekit import assets
    from eaglekit.decode.generate import generate

    q = assets.load_mt_bench()[1]["turns"][0]
    return generate(target, None, target.chat_ids(q), n_new, eos_token_id=False).sequences


# head -> (what the plan was made for, plan): generate(tree="auto") called per prompt would otherwise hash
# the head's weights (~30 ms) every call. Parameters are compared by identity and in-place version.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _made_for(target, head, cache_dir) -> tuple:
    from eaglekit.packed_linear import packed_count

    return (id(target.model), target.fingerprint(), str(target.device), str(target.dtype), str(cache_dir),
            packed_count(target.model), packed_count(head), tuple((id(p), p._version) for p in head.parameters()))


def auto_plan(target, head, cache_dir=None, refresh: bool = False) -> dict:
    """Measure (or read the cached) costs and calibration: ``{"spec", "expected_tokens_per_s",
    "plain_tokens_per_s", "costs", "nodes_with_lookup"}`` for the best tree on this device."""
    made_for = _made_for(target, head, cache_dir)
    if not refresh and head in _PLANS and _PLANS[head][0] == made_for:
        return _PLANS[head][1]
    plan = _load_or_measure(target, head, cache_dir, refresh)
    _PLANS[head] = made_for, plan
    return plan


def _load_or_measure(target, head, cache_dir, refresh: bool) -> dict:
    from eaglekit.assets import cache_dir as default_dir

    path = (cache_dir or default_dir() / "decode-costs") / f"{_key(target, head)}.json"
    if path.exists() and not refresh:
        return json.loads(path.read_text())
    costs = measure(target, head)
    pools = calibrate(target, head, calibration_ids(target))
    spec, rate = choose(costs, pools)
    plan = dict(spec=asdict(spec), expected_tokens_per_s=rate, costs=asdict(costs),
                plain_tokens_per_s=1 / costs.verify(1),
                nodes_with_lookup=nodes_beside_branch(costs, pools[spec.top_k], spec))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan, indent=1))
    os.replace(tmp, path)
    return plan


def auto_tree(target, head, cache_dir=None, refresh: bool = False) -> TreeSpec:
    """The best drafting tree on this device (even where plain decoding would be faster)."""
    return TreeSpec(**auto_plan(target, head, cache_dir, refresh)["spec"])


def drafting_pays(plan: dict) -> bool:
    """Whether the best tree is expected to beat plain decoding (one target forward per token)."""
    return plan["expected_tokens_per_s"] > plan["plain_tokens_per_s"]
