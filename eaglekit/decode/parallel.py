"""Drafting with a parallel head (P-EAGLE, DFlash: ``head.parallel``): ONE head forward per step proposes
a token distribution for each of the block's depths, and the tree is built from those per-depth top-k.

``ParallelDrafter`` keeps the head's cache of exact elements, as ``HeadProposer`` does: after each verify
the accepted tokens are pending with the target's features, and the next ``head.draft`` appends them and
returns the block's logits ``[D, Vd]``: depth d for token x_{t+1+d}, t the last pending element (whose
token x_{t+1} is the root). ``block_tree`` turns them into a tree.

Which trees are sound. Depth d's distribution q_d does not condition on the tokens chosen at depths < d
(the block sees mask slots there), so it is the head's guess of token d *given that the earlier guesses
were right*, whichever sibling that is. A tree whose depth-d nodes all carry children from the same top-k
of q_{d+1} is therefore the natural shape: the product of per-depth top-k sets, of which the planner keeps
the ``total_tokens`` paths with the highest product of per-depth probabilities (``TreeSpec``: ``depth``
<= ``draft_depths``, ``top_k`` per depth, the best ``total_tokens`` nodes). Alternatives under a sibling
that is not the depth's argmax are worth less than the same tokens under an autoregressive head (they
were not drafted for that sibling), which the product score already charges; a chain (``top_k`` = 1) is
the block's argmax. Exactness does not depend on the shape: every node is *chosen* (a deterministic
function of the context), so each is a one-hot proposal and ``sampling.accept_deterministic`` (accept
child x with probability p(x), else zero it and renormalise, then the next sibling) emits exactly a
sample of p at every node, for any tree whose siblings are distinct tokens, which a top-k gives.
"""
from __future__ import annotations

import copy

import torch

from eaglekit.decode.drafters import Tree, TreeSpec, select_best
from eaglekit.heads import check_target
from eaglekit.target import row_output


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

    def __init__(self, target, head, spec: TreeSpec):
        if not getattr(head, "parallel", False):
            raise TypeError(f"ParallelDrafter needs a parallel head (P-EAGLE, DFlash), got {type(head).__name__}")
        check_target(head.config, target, where="decode.generate")
        self.head, self.spec = head, spec
        self.kind = head.config.kind
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
        logits = self.block_logits()  # always: the pending elements must reach the cache
        depth = min(self.spec.depth, self.head.draft_depths, max_depth)
        if depth < 1:
            return Tree.empty(self.device)
        tree = block_tree(torch.log_softmax(logits.float(), -1), self.spec, depth)
        dev = self.device
        return Tree(self.head.draft_to_target(tree.tokens.to(dev)).long(), tree.parents.to(dev),
                    tree.depths.to(dev), tree.q_token.to(dev))
