"""Which drafter ``generate`` runs: ``make_drafter``, and ``tree="auto"``'s plan for a head on this device.

``make_drafter(target, drafter, ...)`` turns what a caller passes (None, a draft Target, an EAGLE head, or
a ready drafter) into a ``drafters.Drafter``, optionally with a prompt-lookup branch grafted on. The
option helpers at the end (``parse_tree``, ``load_drafter``, ...) read the CLIs' spelling of the same.

``tree="auto"`` sizes the head's EAGLE-2 tree from what verification and drafting cost here: verifying m
tokens costs the target c(m), one draft level of k nodes costs the head d(k) (``cost.measure``, once per
device, target, head shape and dtype, cached as JSON under the eaglekit cache dir, ``decode-costs/``).
The expected tokens per step of a tree is 1 + Σ over its nodes of the node's path probability under the
head (EAGLE-2's observation: the draft's confidence predicts acceptance), taken from a short calibration
run of the head on a real prompt. The spec maximising E[tokens] / (d(pending) + (depth-1)·d(top_k) +
c(total_tokens + 1)) wins: on a CPU, where c grows quickly, that is a small tree; on a GPU, where c stays
nearly flat over dozens of tokens, a large one. Where no tree is expected to beat plain decoding, "auto"
decodes without drafting.

A parallel head (P-EAGLE: ``head.parallel``) drafts its whole tree in one forward: d is then that forward's
time whatever the tree (``Costs.draft_s``), the tree is built from the block's per-depth top-k
(``parallel.block_tree``) and is at most ``head.draft_depths`` deep.

A batch of B rows is planned for B (``auto_plan(..., batch_size=B)``, cached per B): c is then measured
for B × m tokens, drafting costs B × d (each row drafts alone), a step emits B × E[tokens]; plain decoding
emits B tokens per forward. As B grows the forward stops being memory-bound, c(m) grows with m and the
best tree shrinks until none pays: "auto" then decodes the batch without drafting.
"""
from __future__ import annotations

import hashlib
import json
import warnings
import weakref
from dataclasses import asdict, dataclass, field

import torch

from eaglekit import __version__, assets
from eaglekit.decode.cost import LEVEL_SIZES, VERIFY_SIZES, Costs, device_name, measure
from eaglekit.decode.drafters import Drafter, EagleDrafter, ModelDrafter, ModelTreeDrafter, PlainDrafter
from eaglekit.decode.lookup import LookupDrafter
from eaglekit.decode.loop import run
from eaglekit.decode.parallel import ParallelDrafter
from eaglekit.decode.proposers import HeadProposer
from eaglekit.decode.sampling import Sampling
from eaglekit.decode.tree import TreeSpec
from eaglekit.fileio import write_text
from eaglekit.heads import load_head
from eaglekit.packed_linear import pack_linears, packed_count
from eaglekit.target import load_target

MAX_DEPTH = 8
PLAN_FORMAT = 2  # bumped when a plan gains fields or is measured differently: cached plans are then remade
# What a prompt-lookup branch (lookup.BY_MATCH) adds on the steps that have one: rows to the verify and
# accepted tokens. Tuned on a 2-core CPU with an EAGLE-3 head on SmolLM2 (MT-bench).
BRANCH_ROWS, BRANCH_TOKENS = 3, 0.8


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


def make_drafter(target, drafter, sampling: Sampling | None = None, generator: torch.Generator | None = None,
                 tree=None, gamma: int = 4, prompt_lookup=0) -> Drafter:
    """The drafter for ``drafter``: None → plain decoding; another Target sharing the tokenizer → a chain of
    ``gamma`` tokens sampled with ``sampling``; an EAGLE head → its EAGLE-2 tree (``tree``: a ``TreeSpec``,
    a dict of its fields, a ``Plan``, or "auto" for ``auto_plan``'s); anything following the ``Drafter``
    protocol → itself. ``prompt_lookup`` (``lookup.LookupDrafter``'s tokens) grafts a prompt-lookup branch
    on top; with a plan, the head keeps the plan's ``nodes_with_lookup`` nodes on steps that have one."""
    inner, plan = _inner(target, drafter, sampling or Sampling(), generator, tree, gamma)
    if not prompt_lookup:
        return inner
    return LookupDrafter(inner, prompt_lookup, inner_nodes=None if plan is None else plan.nodes_with_lookup)


def make_row_drafters(target, drafter, rows: int, sampling: Sampling | None = None,
                      generator: torch.Generator | None = None, tree=None, gamma: int = 4,
                      prompt_lookup=0) -> list[Drafter]:
    """One drafter per row of a batch of ``rows`` prompts: ``make_drafter``'s (a ``Drafter`` given serves
    row 0, its counters count row 0's steps), then ``fork()`` copies of it (one model, a state per row);
    ``drafter`` may also be a list with one drafter (or head, ...) per row. ``tree="auto"`` with a head:
    the plan for this batch size, plain decoding where no tree pays."""
    if isinstance(drafter, (list, tuple)):
        if len(drafter) != rows:
            raise ValueError(f"{len(drafter)} drafters for a batch of {rows} prompts: give one per prompt")
        return [make_drafter(target, d, sampling, generator, tree, gamma, prompt_lookup) for d in drafter]
    if tree == "auto" and _is_head(drafter) and rows > 1:  # planned for this batch size
        tree = auto_plan(target, drafter, batch_size=rows)
        if not tree.drafting_pays:
            warnings.warn(f"tree='auto': for a batch of {rows} this head's best tree is expected at "
                          f"{tree.expected_tokens_per_s:.1f} tokens/s, plain batched decoding at "
                          f"{tree.plain_tokens_per_s:.1f} on this device: decoding without drafting", stacklevel=3)
            drafter = None
    first = make_drafter(target, drafter, sampling, generator, tree, gamma, prompt_lookup)
    if rows > 1 and not hasattr(first, "fork"):
        raise TypeError(f"a batch drafts each row with its own drafter: give {type(first).__name__} a fork() "
                        f"method, or pass a list of {rows} drafters, one per prompt")
    return [first] + [first.fork() for _ in range(rows - 1)]


def _inner(target, drafter, sampling, generator, tree, gamma) -> tuple[Drafter, Plan | None]:
    if drafter is None:
        return PlainDrafter(), None
    if hasattr(drafter, "fingerprint") and hasattr(drafter, "tokenizer"):  # another Target
        return ModelDrafter(target, drafter, gamma, sampling, generator), None
    if _is_head(drafter):
        plan = auto_plan(target, drafter) if tree == "auto" else tree if isinstance(tree, Plan) else None
        if tree == "auto" and not plan.drafting_pays:  # plain decoding where no tree is expected to pay
            warnings.warn(f"tree='auto': this head's best tree is expected at {plan.expected_tokens_per_s:.1f} "
                          f"tokens/s, plain decoding at {plan.plain_tokens_per_s:.1f} on this device: "
                          "decoding without drafting (pass an explicit tree to draft anyway)", stacklevel=4)
            return PlainDrafter(), None
        make = ParallelDrafter if getattr(drafter, "parallel", False) else EagleDrafter
        if plan is not None:
            return make(target, drafter, plan.spec), plan
        spec = tree if isinstance(tree, TreeSpec) else TreeSpec(**(tree or {}))
        return make(target, drafter, spec), None
    if hasattr(drafter, "draft") and hasattr(drafter, "commit"):  # anything following the protocol
        return drafter, None
    raise TypeError(f"drafter must be None, a Target or an EAGLE head, got {type(drafter).__name__}")


def _is_head(drafter) -> bool:
    """An EAGLE head (it steps) or a parallel one (it drafts a block: P-EAGLE, DFlash)."""
    return (hasattr(drafter, "step") or getattr(drafter, "parallel", False)) and hasattr(drafter, "config")


def _max_depth(head) -> int:
    """The deepest tree a plan considers: a parallel head proposes ``draft_depths`` tokens at most."""
    return min(MAX_DEPTH, head.draft_depths) if getattr(head, "parallel", False) else MAX_DEPTH


@torch.no_grad()
def calibrate(target, head, ids: torch.Tensor, contexts: int = 4, depth: int = MAX_DEPTH,
              ks=LEVEL_SIZES) -> dict:
    """Per top_k: for each calibration context, every pool node's (depth, path probability)."""
    taps = HeadProposer(target, head)  # what the head reads of the target
    out = target.forward(ids, kind=taps.kind, layer_ids=taps.layer_ids, logits=False)
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
    return run(target, PlainDrafter(), target.chat_ids(q), n_new, Sampling()).sequences


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


def _pools(target, head):
    made_for = _made_for(target, head, None)
    if head not in _POOLS or _POOLS[head][0] != made_for:
        _POOLS[head] = made_for, calibrate(target, head, calibration_ids(target))
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


def auto_tree(target, head, cache_dir=None, refresh: bool = False) -> TreeSpec:
    """The best drafting tree on this device (even where plain decoding would be faster)."""
    return auto_plan(target, head, cache_dir, refresh).spec


# ---- options as the CLIs (generate, bench) and the demo spell them -------------------------------------

def parse_tree(text: str):
    """``tree=``/``draft_tree=``: "auto" or "depth,top_k,total_tokens" (e.g. "5,8,48") as a ``TreeSpec``."""
    if text == "auto":
        return "auto"
    try:
        depth, top_k, total = (int(x) for x in str(text).split(","))
    except ValueError:
        raise ValueError(f"tree={text!r}: expected 'auto' or 'depth,top_k,total_tokens' (e.g. 5,8,48)") \
            from None
    return TreeSpec(depth, top_k, total)


def load_drafter(cfg, target):
    """``cfg.head`` (a saved head folder or Hub id) or ``cfg.draft`` (a draft model), loaded for ``target``."""
    if cfg.head and cfg.draft:
        raise ValueError("give either head= or draft=, not both")
    if cfg.head:
        return load_head(cfg.head, target)
    if cfg.draft:
        return load_target(cfg.draft, dtype=target.dtype, device=cfg.device)
    return None


def with_draft_tree(cfg, target, drafter):
    """``draft_tree=`` with ``draft=``: wrap the draft model in a ``ModelTreeDrafter``; else unchanged."""
    if not cfg.draft_tree:
        return drafter
    if not cfg.draft:
        raise ValueError("draft_tree= needs draft= (a head drafts a tree through tree=)")
    return ModelTreeDrafter(target, drafter, parse_tree(cfg.draft_tree))


def use_cpu_linear(choice: str, *models) -> int:
    """Apply ``cpu_linear=`` to targets / heads / draft models (None skipped); returns linears packed."""
    if choice not in ("packed", "aten"):
        raise ValueError(f"cpu_linear={choice!r}: expected 'packed' or 'aten'")
    if choice == "aten":
        return 0
    return sum(pack_linears(getattr(m, "model", m)) for m in models if m is not None)
