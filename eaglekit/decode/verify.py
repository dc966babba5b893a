"""One verification: the target's forward over the root and a draft tree, then the acceptance walk.

Row 0 of the verify forward is the root (the last emitted token, not yet in the target's cache), row
``i + 1`` is tree node ``i``. The walk starts at the root's row and descends into the first child the
acceptance rule accepts; where none is, it samples the next token from what the rule left.
"""
from __future__ import annotations

import torch

from eaglekit.decode import kv
from eaglekit.decode.sampling import Sampling, rule_for, sample
from eaglekit.decode.tree import Tree, additive, ancestors


def verify(target, cache, root: int, tree: Tree, drafter):
    """One target forward over the root and every tree node (tree mask, position = past + depth), with
    the taps ``drafter`` reads. Returns (its ``TargetOutput``, the cache length before it). The ids,
    positions and mask are built on the target's device from the tree's index tensors."""
    past = kv.cache_length(cache)
    dev = target.device
    ids = torch.cat([torch.tensor([root], device=dev), tree.tokens.to(dev)])[None]
    pos = past + torch.cat([torch.zeros(1, dtype=torch.long, device=dev), tree.depths.to(dev)])[None]
    mask = None
    if not tree.is_chain:  # a chain is causal: transformers' own mask (its windows included) is the same
        allowed = torch.cat([torch.ones(len(tree) + 1, past, dtype=torch.bool, device=dev),
                             ancestors(tree.parents.to(dev))], 1)
        mask = layer_masks(target, allowed[None], pos, torch.cat([torch.arange(past, device=dev)[None], pos], 1))
    out = target.forward(ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                         kind=drafter.kind, layer_ids=drafter.layer_ids)
    return out, past


def layer_masks(target, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """The additive float masks [B, 1, Q, K] of one forward, from ``allowed`` [B, Q, K] (bool, True = attend)
    and the positions of its queries [B, Q] and keys [B, K]: per layer type, a sliding-window type also hides
    keys ``window`` or more positions behind the query (transformers' rule, by position: a node's slot is
    not its position). One type: one tensor; several: a dict keyed by layer type, which transformers' models
    that mix types take as it is. Floats, since eager attention (Gemma-2, gpt-oss) adds the mask."""
    masks = {}
    for kind, window in getattr(target, "attention_windows", {"full_attention": None}).items():
        seen = allowed if window is None else allowed & (q_pos[:, :, None] - k_pos[:, None, :] < window)
        masks[kind] = additive(seen.to(target.device), target.dtype)[:, None]
    return next(iter(masks.values())) if len(masks) == 1 else masks


def verify_batch(target, cache, roots: list[int], trees: list[Tree], starts: list[int], lengths: list[int],
                 drafter):
    """One target forward over every row's root and tree; row b's cache slots [starts[b], lengths[b]) are its
    text. Trees are padded to the largest with dummy nodes (the root's token, seeing the row's text and
    themselves: finite, never accepted, their KV never kept). Row b's verify row i + 1 is its node i, at
    position (its text length) + depth. Returns (the ``TargetOutput``, the cache length before it)."""
    past, dev = kv.cache_length(cache), target.device
    n = max(len(t) for t in trees)
    ids = torch.tensor(roots, device=dev)[:, None].repeat(1, 1 + n)
    pos = torch.tensor([m - s for s, m in zip(starts, lengths)], device=dev)[:, None].repeat(1, 1 + n)
    allowed = torch.zeros(len(trees), 1 + n, past + 1 + n, dtype=torch.bool, device=dev)
    allowed[:, :, past:] = torch.eye(1 + n, dtype=torch.bool, device=dev)
    for b, tree in enumerate(trees):
        k = len(tree)
        ids[b, 1:1 + k] = tree.tokens.to(dev)
        pos[b, 1:1 + k] += tree.depths.to(dev)
        allowed[b, :, starts[b]:lengths[b]] = True
        allowed[b, :1 + k, past:past + 1 + k] = ancestors(tree.parents.to(dev))
    # row b's text slot s is at position s - start
    slots = torch.arange(past, device=dev)[None] - torch.tensor(starts, device=dev)[:, None]
    mask = layer_masks(target, allowed, pos, torch.cat([slots, pos], 1))
    out = target.forward(ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                         kind=drafter.kind, layer_ids=drafter.layer_ids)
    return out, past


def accept(logits: torch.Tensor, tree: Tree, sampling: Sampling, generator=None,
           rule=None, argmax: list[int] | None = None) -> tuple[list[int], int]:
    """Walk down from the root: (accepted node indices, next token sampled from what is left).

    ``logits`` [n + 1, V] are the verify rows. Greedy: follow the child equal to the row's argmax (every
    row's argmax read from the device at once; ``argmax`` if the caller read them already, with other
    rows). Else ``rule`` (default ``sampling.rule_for(tree)``) decides at each row among its children."""
    kids, tokens = tree.children(), tree.host()[0]
    if sampling.greedy:
        best = logits.argmax(-1).tolist() if argmax is None else argmax
        row, path = 0, []
        while True:
            hit = [c for c in kids[row] if tokens[c] == best[row]]
            if not hit:
                return path, best[row]
            path.append(hit[0])
            row = hit[0] + 1
    rule = rule or rule_for(tree)
    q_full = tree.q_full
    row, path = 0, []
    while True:
        ch = kids[row]
        p = sampling.probs(logits[row])
        q = None if q_full is None else q_full[ch]
        i, left = rule(p, [tokens[c] for c in ch], tree.q_token[ch], q, generator) if ch else (None, p)
        if i is None:
            return path, sample(left, generator)
        node = ch[i]
        path.append(node)
        row = node + 1


def accepted_rows(path: list[int]) -> torch.Tensor:
    """Verify rows of the root and the accepted nodes: what the target's cache keeps."""
    return torch.tensor([0] + [n + 1 for n in path])
