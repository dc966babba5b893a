"""Draft trees: the structure, its verification mask, and EAGLE-2 dynamic expansion.

A tree hangs below a *root*: the last emitted token, not yet in the target's cache. Nodes are stored
parents before children; ``parents[i] = -1`` means a child of the root. In the verify forward, row 0
is the root and row ``i + 1`` is node ``i``; a node's position id is ``past_len + depth``.

``expand`` grows an EAGLE-2 dynamic tree from any *proposer* (an EAGLE head or a draft model, see
``proposers.py``): something that runs a few tokens through its own cache under a given mask.
"""
from __future__ import annotations

from dataclasses import dataclass

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

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @staticmethod
    def empty(device=None) -> Tree:
        z = torch.zeros(0, dtype=torch.long, device=device)
        return Tree(z, z.clone(), z.clone(), torch.zeros(0, device=device))

    @staticmethod
    def chain(tokens: torch.Tensor, q_token: torch.Tensor, q_full=None, sampled=False) -> Tree:
        n = len(tokens)
        ar = torch.arange(n, device=tokens.device)
        return Tree(tokens, ar - 1, ar + 1, q_token, q_full, sampled)

    @property
    def is_chain(self) -> bool:
        return bool(torch.equal(self.parents.cpu(), torch.arange(len(self)) - 1))

    def path_tokens(self, path: list[int]) -> list[int]:
        """Token ids of the nodes ``path`` (e.g. an accepted path), in order."""
        return self.tokens[path].tolist() if path else []

    def children(self) -> list[list[int]]:
        """Children node indices of each verify row (row 0 = root, row i+1 = node i), in draft order."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents.tolist()):
            kids[p + 1].append(i)
        return kids


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """Bool [n+1, n+1] over verify rows: ``a[i, j]`` = row j is row i or one of its ancestors."""
    n = len(parents)
    a = torch.eye(n + 1, dtype=torch.bool)
    for i, p in enumerate(parents.tolist()):
        a[i + 1] |= a[p + 1]
    return a


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool (True = attend) → additive float mask (0 / finfo.min); eager attention needs floats."""
    m = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return m.masked_fill_(~allowed, torch.finfo(dtype).min)


def verify_mask(tree: Tree, past_len: int, dtype, device) -> torch.Tensor:
    """[1, 1, n+1, past_len + n+1]: every row sees the whole prefix, then only its ancestors (and itself)."""
    a = ancestors(tree.parents)
    prefix = torch.ones(len(a), past_len, dtype=torch.bool)
    return additive(torch.cat([prefix, a], dim=1).to(device), dtype)[None, None]


def select_best(scores: torch.Tensor, parents: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ``total`` best nodes of a pool (scores = log path probability), in pool order.

    A child never scores above its parent and a stable sort ranks a parent before an equal child, so
    the kept set is closed under ancestors. Returns (kept pool indices, their parents re-indexed).
    """
    order = torch.sort(scores, descending=True, stable=True).indices[:total]
    kept = torch.sort(order).values
    new_index = torch.full((len(scores) + 1,), -1, dtype=torch.long)
    new_index[kept.cpu() + 1] = torch.arange(len(kept))
    new_parents = new_index[parents[kept].cpu() + 1]
    if bool(((new_parents < 0) & (parents[kept].cpu() >= 0)).any()):
        raise AssertionError("select_best: kept set not closed under ancestors")
    return kept, new_parents.to(parents.device)


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
    proposer's cache back to the committed elements afterwards.
    """
    committed = proposer.length
    k = min(spec.top_k, root_logits.shape[-1])
    top = torch.log_softmax(root_logits.float(), -1).topk(k)
    # the candidate pool (all levels; pool order = parents before children), bookkept on the CPU
    tokens, logq = [top.indices.cpu()], [top.values.cpu()]
    parents, depths, scores = [torch.full((k,), -1)], [torch.ones(k, dtype=torch.long)], [logq[0]]
    frontier = torch.arange(k)  # pool indices expanded at the next level
    feed = None if root_hidden is None else root_hidden.expand(k, -1)  # a child takes its parent's output
    slots: dict[int, int] = {}  # pool index -> proposer cache slot of the node's element
    for d in range(2, depth + 1):
        pool_tokens, pool_parents = torch.cat(tokens), torch.cat(parents)
        ids = proposer.to_target(pool_tokens[frontier].to(proposer.device))
        pos = torch.full((len(frontier),), committed - 1 + d - 1, device=proposer.device)
        mask = _level_mask(proposer, committed, frontier, pool_parents, slots)
        for i, f in enumerate(frontier.tolist()):
            slots[f] = proposer.length + i
        hidden, lg = proposer.step(ids[None], None if feed is None else feed[None], pos[None], mask)
        lp = torch.log_softmax(lg[0].float(), -1).topk(k)  # [len(frontier), k]
        values, indices = lp.values.cpu(), lp.indices.cpu()
        cand = (torch.cat(scores)[frontier][:, None] + values).flatten()
        base = len(pool_tokens)
        tokens.append(indices.flatten())
        logq.append(values.flatten())
        parents.append(frontier.repeat_interleave(k))
        depths.append(torch.full((len(cand),), d, dtype=torch.long))
        scores.append(cand)
        best = cand.topk(min(k, len(cand))).indices
        frontier = base + best
        feed = None if hidden is None else hidden[0][(best // k).to(proposer.device)]
    kept, new_parents = select_best(torch.cat(scores), torch.cat(parents), spec.total_tokens)
    draft_ids = torch.cat(tokens)[kept].to(proposer.device)
    return Tree(tokens=proposer.to_target(draft_ids).long(), parents=new_parents.to(proposer.device),
                depths=torch.cat(depths)[kept].to(proposer.device), q_token=torch.cat(logq)[kept].exp())


def _level_mask(proposer, committed: int, frontier, pool_parents, slots) -> torch.Tensor:
    """Frontier elements see every committed element, their ancestors' elements and themselves."""
    kf, before = len(frontier), proposer.length
    allowed = torch.zeros(kf, before + kf, dtype=torch.bool)
    allowed[:, :committed] = True
    for i, f in enumerate(frontier.tolist()):
        allowed[i, before + i] = True
        a = int(pool_parents[f])
        while a >= 0:
            allowed[i, slots[a]] = True
            a = int(pool_parents[a])
    return additive(allowed.to(proposer.device), proposer.dtype)[None, None]
