"""Drafters and the trees they propose: one protocol (``Drafter``), the drafters that read the target's own
features, the proposers that grow their trees, and the trees themselves (the structure, its verification
mask, EAGLE-2 dynamic expansion).

* ``PlainDrafter`` proposes nothing (plain autoregressive decoding, the baseline).
* ``TreeDrafter`` grows an EAGLE-2 dynamic tree from a proposer (one-hot rule): ``EagleDrafter`` with
  an EAGLE-1/EAGLE-3 head (``HeadProposer``); ``draft_model.ModelTreeDrafter`` with a draft model.
* ``ParallelDrafter`` (at the end): a parallel head (P-EAGLE, DFlash) drafting its tree in one forward.
* Elsewhere: ``draft_model.ModelDrafter`` samples a draft model's chain; ``lookup.LookupDrafter`` wraps any
  tree drafter with a prompt-lookup branch.

Trees. A tree hangs below a *root*: the last emitted token, not yet in the target's cache. Nodes are stored
parents before children; ``parents[i] = -1`` means a child of the root. In the verify forward, row 0
is the root and row ``i + 1`` is node ``i``; a node's position id is ``past_len + depth``.

A proposer (``HeadProposer``, ``draft_model.ModelProposer``) is what ``expand`` grows an EAGLE-2 dynamic tree from: something
that runs a few tokens through its own cache under a given mask. There it keeps *committed* elements (the
accepted text, exactly) and *pending* ones (the last accepted tokens, not yet run). ``start(prompt, out, root)``
after the target's prefill (``out`` its ``TargetOutput``) and ``accept(tokens, out, rows)`` after each verify set
the pending tokens, with the target's features at verify rows ``rows`` (a proposer that reads none ignores
``out``); ``catch_up() -> (hidden, logits)`` runs them in and returns the last one's output (``hidden`` None for a
proposer that feeds no feature to its children); ``step(ids, feed, pos, mask)`` runs [1, S] tokens above the
committed ones under a tree mask; ``to_target``, ``length``, ``crop(n)``; ``layer_ids`` the target layers
``accept`` reads (``()``: none); ``fork()`` a proposer for another sequence sharing the model.
``catch_up(proposers)`` runs the pending elements of every row of one head in one head forward (one row is a
batch of one); a draft model's rows catch up alone.
"""
from __future__ import annotations

import copy
import operator
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch

from eaglekit.heads import check_target
from eaglekit.heads.layers import HeadRows, RowsStep
from eaglekit.target import row_output

# ---- trees: the structure, its verification mask, EAGLE-2 expansion ------------------------------------------

@dataclass(frozen=True)
class TreeSpec:
    """EAGLE-2 dynamic tree: ``depth`` draft levels, ``top_k`` children per expanded node and ``top_k``
    nodes expanded per level, the best ``total_tokens`` nodes (by path probability) verified."""

    depth: int = 5
    top_k: int = 8
    total_tokens: int = 48

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 1:
            raise ValueError(f"TreeSpec needs depth, top_k, total_tokens >= 1, got {self}")

    @classmethod
    def parse(cls, text: str) -> TreeSpec:
        """"depth,top_k,total_tokens" (e.g. "5,8,48"), as the CLIs' ``tree=`` spells it."""
        try:
            depth, top_k, total = (int(x) for x in str(text).split(","))
        except ValueError:
            raise ValueError(f"tree={text!r}: expected 'auto' or 'depth,top_k,total_tokens' (e.g. 5,8,48)") from None
        return cls(depth, top_k, total)


@dataclass
class Tree:
    tokens: torch.Tensor  # [n] target ids
    parents: torch.Tensor  # [n] index of the parent node, -1 = the root
    depths: torch.Tensor  # [n] 1 for the root's children
    q_token: torch.Tensor  # [n] drafter probability of the token given its parent
    q_full: torch.Tensor | None = None  # [n, V] proposal distribution each token was sampled from
    sampled: bool = False  # True: tokens sampled from q (Leviathan rule); False: chosen (one-hot rule)
    known_chain: bool = False  # built as a chain (``chain``, ``empty``): known without reading the parents
    # (tokens, parents, depths) as Python lists, read from the device once (``host``): the acceptance walk,
    # the stats and the drafter's commit all need them, and every read of a device tensor waits for it
    _host: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @staticmethod
    def empty(device=None) -> Tree:
        z = torch.zeros(0, dtype=torch.long, device=device)
        return Tree(z, z.clone(), z.clone(), torch.zeros(0, device=device), known_chain=True)

    @staticmethod
    def chain(tokens: torch.Tensor, q_token: torch.Tensor, q_full=None, sampled=False) -> Tree:
        n = len(tokens)
        ar = torch.arange(n, device=tokens.device)
        return Tree(tokens, ar - 1, ar + 1, q_token, q_full, sampled, known_chain=True)

    def host(self) -> tuple[list[int], list[int], list[int]]:
        """(tokens, parents, depths) as lists: one device read for the tree's life (``fetch`` reads several)."""
        if self._host is None:
            fetch([self])
        return self._host

    @property
    def is_chain(self) -> bool:
        return self.known_chain or self.host()[1] == list(range(-1, len(self) - 1))

    @property
    def depth(self) -> int:
        return max(self.host()[2], default=0)

    def path_tokens(self, path: list[int]) -> list[int]:
        """Token ids of the nodes ``path`` (e.g. an accepted path), in order."""
        tokens = self.host()[0]
        return [tokens[i] for i in path]

    def children(self) -> list[list[int]]:
        """Children node indices of each verify row (row 0 = root, row i+1 = node i), in draft order."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.host()[1]):
            kids[p + 1].append(i)
        return kids


def fetch(trees: list[Tree], extra: torch.Tensor | None = None) -> list | None:
    """Read every tree's (tokens, parents, depths) not read yet, and ``extra`` (e.g. the verify rows'
    argmax), in one device-to-host copy: one sync for a whole batch. Returns ``extra.tolist()``."""
    todo = [t for t in trees if t._host is None]
    dev = extra.device if extra is not None else todo[0].tokens.device if todo else None
    parts = [x.long().to(dev) for t in todo for x in (t.tokens, t.parents, t.depths)]
    if extra is not None:
        parts.append(extra.long().flatten())
    if not parts:
        return None
    flat = torch.cat(parts).tolist()
    at = 0
    for t in todo:
        n = len(t)
        t._host = flat[at:at + n], flat[at + n:at + 2 * n], flat[at + 2 * n:at + 3 * n]
        at += 3 * n
    if extra is None:
        return None
    rest = flat[at:]
    width = extra.shape[-1] if extra.dim() > 1 else len(rest)
    return [rest[i:i + width] for i in range(0, len(rest), width)] if extra.dim() > 1 else rest


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """Bool [n+1, n+1] over verify rows: ``a[i, j]`` = row j is row i or one of its ancestors. Built where
    ``parents`` lives, from index tensors (no read back to the host): a row's parent edge, then the
    transitive closure by repeated squaring (after s squarings paths up to 2^s long are covered)."""
    n, dev = len(parents), parents.device
    a = torch.eye(n + 1, dtype=torch.bool, device=dev)
    a[torch.arange(1, n + 1, device=dev), parents.long() + 1] = True
    for _ in range(max(n, 1).bit_length()):
        f = a.float()
        a = (f @ f) > 0
    return a


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool (True = attend) → additive float mask (0 / finfo.min); eager attention needs floats."""
    m = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return m.masked_fill_(~allowed, torch.finfo(dtype).min)


def select_best(scores: torch.Tensor, parents: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ``total`` best nodes of a pool (scores = log path probability), in pool order.

    A child never scores above its parent and a stable sort ranks a parent before an equal child, so
    the kept set is closed under ancestors (tests check it; not re-checked here, which would read the
    device). Returns (kept pool indices, their parents re-indexed), on the pool's device.
    """
    dev = scores.device
    order = torch.sort(scores, descending=True, stable=True).indices[:total]
    kept = torch.sort(order).values
    new_index = torch.full((len(scores) + 1,), -1, dtype=torch.long, device=dev)
    new_index[kept + 1] = torch.arange(len(kept), device=dev)
    return kept, new_index[parents.to(dev)[kept] + 1]


def down_paths(values: list[float], parents: list[int], combine) -> list[float]:
    """Each node's ``values`` folded down its path from the root, ``combine(own, parent's)``: in Python on
    host lists (parents come first), not a 0-d tensor op per node."""
    out: list[float] = []
    for v, p in zip(values, parents):
        out.append(v if p < 0 else combine(v, out[p]))
    return out


def prune(tree: Tree, total: int) -> Tree:
    """The ``total`` nodes of ``tree`` with the highest path probability (``q_token`` multiplied down the
    path), closed under ancestors, in tree order. A tree of chosen tokens only (``q_token`` is a score)."""
    if len(tree) <= total:
        return tree
    if tree.sampled:
        raise ValueError("prune: a sampled tree's nodes cannot be dropped (the acceptance rule needs them all)")
    log_q = tree.q_token.double().cpu().clamp_min(1e-300).log().tolist()
    path = torch.tensor(down_paths(log_q, tree.host()[1], operator.add), dtype=torch.float64)
    kept, parents = select_best(path, tree.parents.cpu(), total)
    kept = kept.to(tree.tokens.device)
    return Tree(tree.tokens[kept], parents.to(tree.tokens.device), tree.depths[kept], tree.q_token[kept])


def expand(proposer, root_hidden, root_logits: torch.Tensor, spec: TreeSpec, depth: int) -> Tree:
    """EAGLE-2: expand the ``top_k`` best frontier nodes by their ``top_k`` children for ``depth`` levels
    (score = log path probability under the proposer); keep the best ``total_tokens`` of all candidates.

    ``root_logits`` [V] (and ``root_hidden`` [H], the feature fed with the root's children; None for a
    proposer that reads none) come from the proposer's last committed element, which sits at position
    ``proposer.length - 1``. Each level is one ``proposer.step`` over the frontier on top of the committed
    elements (a tree mask: committed elements, the node's ancestors and itself); the caller crops the
    proposer's cache back to the committed elements afterwards. Everything stays on the proposer's device
    (the pool, the masks): no read back to the host while the tree grows.
    """
    dev, committed = proposer.device, proposer.length
    k = min(spec.top_k, root_logits.shape[-1])
    top = torch.log_softmax(root_logits.float(), -1).topk(k)
    # the candidate pool over all levels, parents before children
    tokens, logq, scores = [top.indices.to(dev)], [top.values.to(dev)], [top.values.to(dev)]
    parents = [torch.full((k,), -1, dtype=torch.long, device=dev)]
    depths = [torch.ones(k, dtype=torch.long, device=dev)]
    frontier = torch.arange(k, device=dev)  # pool indices expanded at the next level
    feed = None if root_hidden is None else root_hidden.expand(k, -1)  # a child takes its parent's output
    eye = torch.eye(k, dtype=torch.bool, device=dev)
    sees = None  # [k, this draft's elements so far]: the frontier's ancestors' elements (and their own)
    for d in range(2, depth + 1):
        ids = proposer.to_target(torch.cat(tokens)[frontier])
        pos = torch.full((k,), committed + d - 2, dtype=torch.long, device=dev)
        sees = eye if sees is None else torch.cat([sees, eye], 1)  # this level's elements: one per node
        allowed = torch.cat([torch.ones(k, committed, dtype=torch.bool, device=dev), sees], 1)
        hidden, lg = proposer.step(ids[None], None if feed is None else feed[None], pos[None],
                                   additive(allowed, proposer.dtype)[None, None])
        lp = torch.log_softmax(lg[0].float(), -1).topk(k)  # [k, k]
        cand = (torch.cat(scores)[frontier][:, None] + lp.values).flatten()
        base = sum(len(t) for t in tokens)
        tokens.append(lp.indices.flatten())
        logq.append(lp.values.flatten())
        parents.append(frontier.repeat_interleave(k))
        depths.append(torch.full((len(cand),), d, dtype=torch.long, device=dev))
        scores.append(cand)
        best = cand.topk(k).indices
        frontier, sees = base + best, sees[best // k]  # a child sees what its parent saw, then itself
        feed = None if hidden is None else hidden[0][best // k]
    kept, new_parents = select_best(torch.cat(scores), torch.cat(parents), spec.total_tokens)
    return Tree(tokens=proposer.to_target(torch.cat(tokens)[kept]).long(), parents=new_parents,
                depths=torch.cat(depths)[kept], q_token=torch.cat(logq)[kept].exp())


# ---- drafters and their proposers ----------------------------------------------------------------------------

class Drafter(Protocol):
    """What the decode loop calls, once per sequence (``prefill``) and then once per verify forward.

    ``layer_ids``: the target layers the verify forward taps (``Target.forward``), exactly; ``()`` or None
    taps none.
    ``prefill(prompt, out, root)``: after the target's prefill (``out`` its ``TargetOutput``; ``root`` the
    first token, not yet in the target's cache). ``draft(max_depth) -> Tree``: proposals below the current
    root, at most ``max_depth`` deep. ``commit(tree, path, next_token, out, rows)``: after acceptance, with
    the accepted node indices ``path``, the token sampled after them, and the verify forward's output,
    whose rows ``rows`` (root + accepted nodes) now sit in the target's cache.

    A batch (``decode.generate`` with several prompts) drafts each row with its own drafter: optional
    ``fork()`` returns a fresh drafter of the same kind and settings, sharing the models, for another
    sequence (every drafter here has one; without it, pass a list of drafters, one per row).
    """

    layer_ids: tuple | None

    def prefill(self, prompt: torch.Tensor, out, root: int) -> None: ...

    def draft(self, max_depth: int) -> Tree: ...

    def commit(self, tree: Tree, path: list[int], next_token: int, out, rows: torch.Tensor) -> None: ...


class PlainDrafter:
    layer_ids = ()

    def prefill(self, prompt, out, root):
        pass

    def draft(self, max_depth: int) -> Tree:
        return Tree.empty()

    def commit(self, tree, path, next_token, out, rows):
        pass

    def fork(self) -> PlainDrafter:
        return PlainDrafter()


class HeadProposer:
    """An EAGLE-1/EAGLE-3 head with its own cache: one row of the buffer every decode row of that head shares
    (``rows_of(head)``, a ``heads.layers.HeadRows``), taken at ``start``, freed when dropped.

    The head's element t is (feature g_t, token x_{t+1}) at position t. Accepted tokens are fed back with
    the *target's* features from the verify forward (the tree's own elements, drafted from the head's
    predicted features, are cropped away after drafting), so the head cache only ever holds exact
    elements; the target's cache is never re-run.
    """

    def __init__(self, target, head):
        check_target(head.config, target, where="decode.generate")
        self.head = head
        # the target layers this head reads, exactly (() for EAGLE-1): what the verify forward taps
        self.layer_ids = type(head).tap_layers(target, head.config.aux_layer_ids)
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype

    def _features(self, out, rows: torch.Tensor) -> torch.Tensor:
        return self.head.fuse_output(row_output(out, 0, rows, self.device))[0]

    def fork(self) -> HeadProposer:
        return copy.copy(self)  # start() replaces the per-sequence state a copy shares

    def start(self, prompt, out, root: int) -> None:
        self.cache, self.caught = rows_of(self.head).row(), None
        self.pending = (torch.tensor(prompt[0, 1:].tolist() + [root], device=self.device),
                        self._features(out, torch.arange(prompt.shape[1])))

    def accept(self, tokens: list[int], out, rows: torch.Tensor) -> None:
        self.pending = torch.tensor(tokens, device=self.device), self._features(out, rows)

    def catch_up(self):
        if self.caught is None:  # not run with the other rows of its head (``catch_up``)
            catch_up([self])
        out, self.caught = self.caught, None
        return out

    def step(self, ids, feed, pos, mask):
        return self.head.step(ids, feed, pos, cache=self.cache, attn_mask=mask)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.draft_to_target(ids)

    @property
    def length(self) -> int:
        return self.cache.length

    def crop(self, n: int) -> None:
        self.cache.crop(n)


# head -> the HeadRows every decode row of that head keeps its cache in (one buffer, a batch row each)
_HEAD_ROWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rows_of(head) -> HeadRows:
    rows = _HEAD_ROWS.get(head)
    if rows is None:
        rows = _HEAD_ROWS[head] = HeadRows(head.config.num_layers)
    return rows


@torch.no_grad()
def catch_up(proposers: list[HeadProposer]) -> None:
    """Run the rows' pending elements through one head forward per head; each row's next
    ``HeadProposer.catch_up`` returns its last element's output. One row runs on its own cache, causally.
    Several rows of one head: their pending elements, right-padded to the longest, go through one forward
    over the rows' shared buffer (``RowsStep``: row b's new entries written in place at its own length, a
    mask that lets it see only its own cache and elements), so each row gets the output and cache entries
    it would have computed alone (up to float rounding: the sums run over padded lengths)."""
    groups: dict[int, list[HeadProposer]] = {}
    for p in proposers:
        groups.setdefault(id(p.cache.rows), []).append(p)
    for group in groups.values():
        (_catch_up_one if len(group) == 1 else _catch_up_rows)(group)


def _catch_up_one(group: list[HeadProposer]) -> None:
    p = group[0]
    ids, g = p.pending
    pos = torch.arange(p.length, p.length + len(ids), device=p.device)
    hidden, logits = p.head.step(ids[None], g[None], pos[None], cache=p.cache)
    p.caught = hidden[0, -1], logits[0, -1]


def _catch_up_rows(group: list[HeadProposer]) -> None:
    first, slots = group[0], [p.cache.slot for p in group]
    lo, new = min(slots), max(len(p.pending[0]) for p in group)
    step = RowsStep(first.cache.rows, lo, max(slots) + 1, first.device)
    ids = torch.zeros(len(step.offsets), new, dtype=torch.long, device=first.device)
    g = torch.zeros(len(step.offsets), new, first.head.config.hidden_size, dtype=first.dtype, device=first.device)
    for p in group:
        n = len(p.pending[0])
        ids[p.cache.slot - lo, :n], g[p.cache.slot - lo, :n] = p.pending
    hidden, logits = first.head.step(ids, g, step.positions(new), cache=step, attn_mask=step.mask(new, first.dtype))
    for p in group:
        n = len(p.pending[0])
        step.advance(p.cache.slot, n)
        p.caught = hidden[p.cache.slot - lo, n - 1], logits[p.cache.slot - lo, n - 1]


class TreeDrafter:
    """An EAGLE-2 dynamic tree grown by a proposer (``HeadProposer`` or ``ModelProposer``).

    Each draft first runs the tokens accepted since the last one through the proposer's cache, then
    expands the tree level by level above them (``expand``) and crops the proposer's cache back to
    the accepted text. Candidates are chosen (top-k), so acceptance uses the one-hot rule, exact at any
    temperature.
    """

    def __init__(self, proposer, spec: TreeSpec):
        self.proposer, self.spec = proposer, spec
        self.layer_ids = proposer.layer_ids

    def fork(self) -> TreeDrafter:
        """Another sequence's drafter (same spec, the proposer's model shared, its cache not)."""
        new = copy.copy(self)
        new.proposer = self.proposer.fork()
        return new

    def prefill(self, prompt, out, root):
        self.proposer.start(prompt, out, root)

    def commit(self, tree, path, next_token, out, rows):
        self.proposer.accept(tree.path_tokens(path) + [next_token], out, rows)

    @torch.no_grad()
    def draft(self, max_depth: int) -> Tree:
        hidden, logits = self.proposer.catch_up()
        depth = min(self.spec.depth, max_depth)
        if depth == 0:
            return Tree.empty(self.proposer.device)
        committed = self.proposer.length
        tree = expand(self.proposer, hidden, logits, self.spec, depth)
        self.proposer.crop(committed)
        return tree


class EagleDrafter(TreeDrafter):
    """EAGLE-2 dynamic tree from an EAGLE-1/EAGLE-3 head (``HeadProposer``: the head keeps its own cache)."""

    def __init__(self, target, head, spec: TreeSpec):
        super().__init__(HeadProposer(target, head), spec)


def catch_up_rows(drafters: list) -> None:
    """Before drafting, the rows drafting with an EAGLE head (``TreeDrafter``s, bare or under a
    ``LookupDrafter``) run their pending elements in: the rows of each head in one head forward
    (``catch_up``). Other drafters catch up in their own ``draft``."""
    rows = [p for d in drafters if isinstance(p := getattr(getattr(d, "inner", d), "proposer", None), HeadProposer)
            and p.caught is None]
    if rows:
        catch_up(rows)


# ---- a parallel head's drafter (P-EAGLE, DFlash): one forward per step ------------------------------------
# Drafting with a parallel head (P-EAGLE, DFlash: ``head.parallel``): ONE head forward per step proposes
# a token distribution for each of the block's depths, and the tree is built from those per-depth top-k.
#
# ``ParallelDrafter`` keeps the head's cache of exact elements, as ``HeadProposer`` does: after each verify
# the accepted tokens are pending with the target's features, and the next ``head.draft`` appends them and
# returns the block's logits ``[D, Vd]``: depth d for token x_{t+1+d}, t the last pending element (whose
# token x_{t+1} is the root). ``block_tree`` turns them into a tree.
#
# Which trees are sound. Depth d's distribution q_d does not condition on the tokens chosen at depths < d
# (the block sees mask slots there), so it is the head's guess of token d *given that the earlier guesses
# were right*, whichever sibling that is. A tree whose depth-d nodes all carry children from the same top-k
# of q_{d+1} is therefore the natural shape: the product of per-depth top-k sets, of which the planner keeps
# the ``total_tokens`` paths with the highest product of per-depth probabilities (``TreeSpec``: ``depth``
# <= ``draft_depths``, ``top_k`` per depth, the best ``total_tokens`` nodes). Alternatives under a sibling
# that is not the depth's argmax are worth less than the same tokens under an autoregressive head (they
# were not drafted for that sibling), which the product score already charges; a chain (``top_k`` = 1) is
# the block's argmax. Exactness does not depend on the shape: every node is *chosen* (a deterministic
# function of the context), so each is a one-hot proposal and ``loop.accept_deterministic`` (accept
# child x with probability p(x), else zero it and renormalise, then the next sibling) emits exactly a
# sample of p at every node, for any tree whose siblings are distinct tokens, which a top-k gives.


def block_tree(logq: torch.Tensor, spec: TreeSpec, depth: int) -> Tree:
    """A tree of draft ids from per-depth log-probabilities ``logq`` [>= depth, Vd]: EAGLE-2's level-wise
    growth with the block's depth-d top-k as every depth-d node's children (score = sum of the path's
    per-depth log-probabilities), the best ``spec.total_tokens`` nodes kept, parents before children."""
    k = min(spec.top_k, logq.shape[-1])
    top = logq[:depth].float().cpu().topk(k, dim=-1)
    tokens, logp = [top.indices[0]], [top.values[0]]
    parents, depths, scores = [torch.full((k,), -1)], [torch.ones(k, dtype=torch.long)], [top.values[0]]
    frontier = torch.arange(k)
    for d in range(2, depth + 1):
        base = sum(len(s) for s in scores)
        cand = (torch.cat(scores)[frontier][:, None] + top.values[d - 1][None]).flatten()
        tokens.append(top.indices[d - 1].repeat(len(frontier)))
        logp.append(top.values[d - 1].repeat(len(frontier)))
        parents.append(frontier.repeat_interleave(k))
        depths.append(torch.full((len(cand),), d, dtype=torch.long))
        scores.append(cand)
        frontier = base + cand.topk(min(k, len(cand))).indices
    kept, new_parents = select_best(torch.cat(scores), torch.cat(parents), spec.total_tokens)
    return Tree(tokens=torch.cat(tokens)[kept], parents=new_parents, depths=torch.cat(depths)[kept],
                q_token=torch.cat(logp)[kept].exp())


class ParallelDrafter:
    """A parallel head's drafter: one ``head.draft`` forward per step, a ``block_tree`` of its depths."""

    def __init__(self, target, head, spec: TreeSpec, sampling=None, generator=None):
        if not getattr(head, "parallel", False):
            raise TypeError(f"ParallelDrafter needs a parallel head (P-EAGLE, DFlash), got {type(head).__name__}")
        check_target(head.config, target, where="decode.generate")
        self.head, self.spec = head, spec
        # a head that samples its own block (DFlash 2's selector walk: ``draft_sampled``) proposes a sampled
        # chain under a sampling ``Sampling``: its q goes to Leviathan's rule. Greedy, or any other head: a tree
        # of chosen tokens from the block's logits
        self.sampling = sampling if sampling is not None and not sampling.greedy and hasattr(head, "draft_sampled") \
            else None
        self.generator = generator
        self.layer_ids = type(head).tap_layers(target, head.config.aux_layer_ids)  # what it reads, exactly
        self.device = next(head.parameters()).device

    def fork(self) -> ParallelDrafter:
        return copy.copy(self)  # prefill() replaces the per-sequence state a copy shares

    def _features(self, out, rows: torch.Tensor) -> torch.Tensor:
        return self.head.fuse_output(row_output(out, 0, rows, self.device))[0]

    def prefill(self, prompt, out, root: int) -> None:
        self.cache = self.head.new_cache()
        self.pending = (torch.tensor(prompt[0, 1:].tolist() + [root], device=self.device),
                        self._features(out, torch.arange(prompt.shape[1])))

    def commit(self, tree, path, next_token, out, rows) -> None:
        self.pending = (torch.tensor(tree.path_tokens(path) + [next_token], device=self.device),
                        self._features(out, rows))

    def block_logits(self) -> torch.Tensor:
        """Run the pending elements into the cache (one head forward); the block's logits [D, Vd]."""
        ids, g = self.pending
        pos = torch.arange(self.cache.length, self.cache.length + len(ids), device=self.device)
        return self.head.draft(self.cache, ids[None], g[None], pos[None])[0]

    @torch.no_grad()
    def draft(self, max_depth: int) -> Tree:
        if self.sampling is not None:
            return self.draft_sampled(max_depth)
        logits = self.block_logits()  # always: the pending elements must reach the cache
        depth = min(self.spec.depth, self.head.draft_depths, max_depth)
        if depth < 1:
            return Tree.empty(self.device)
        tree = block_tree(torch.log_softmax(logits.float(), -1), self.spec, depth)
        dev = self.device
        return Tree(self.head.draft_to_target(tree.tokens.to(dev)).long(), tree.parents.to(dev),
                    tree.depths.to(dev), tree.q_token.to(dev))

    def draft_sampled(self, max_depth: int) -> Tree:
        """A chain sampled by the head's own walk (each token from q given the ones before it), with its q
        [D, V] over the target's ids: verified by ``loop.accept_sampled`` (Leviathan), lossless for any q."""
        ids, g = self.pending
        pos = torch.arange(self.cache.length, self.cache.length + len(ids), device=self.device)
        toks, q = self.head.draft_sampled(self.cache, ids[None], g[None], pos[None], self.sampling.probs,
                                          self.generator)
        depth = min(self.spec.depth, self.head.draft_depths, max_depth)
        if depth < 1:
            return Tree.empty(self.device)
        toks, q = self.head.draft_to_target(toks[0, :depth]).long(), q[0, :depth]
        return Tree.chain(toks, q.gather(1, toks[:, None])[:, 0], q, sampled=True)
