"""Draft trees: the structure, its verification mask, and EAGLE-2 dynamic expansion.

A tree hangs below a *root*: the last emitted token, not yet in the target's cache. Nodes are stored
parents before children; ``parents[i] = -1`` means a child of the root. In the verify forward, row 0
is the root and row ``i + 1`` is node ``i``; a node's position id is ``past_len + depth``.

``expand`` grows an EAGLE-2 dynamic tree from any *proposer* (an EAGLE head or a draft model, see
``drafters.py``): something that runs a few tokens through its own cache under a given mask.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


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


def prune(tree: Tree, total: int) -> Tree:
    """The ``total`` nodes of ``tree`` with the highest path probability (``q_token`` multiplied down the
    path), closed under ancestors, in tree order. A tree of chosen tokens only (``q_token`` is a score)."""
    if len(tree) <= total:
        return tree
    if tree.sampled:
        raise ValueError("prune: a sampled tree's nodes cannot be dropped (the acceptance rule needs them all)")
    path = tree.q_token.double().cpu().clamp_min(1e-300).log()
    for i, p in enumerate(tree.parents.tolist()):  # parents come first
        if p >= 0:
            path[i] += path[p]
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
