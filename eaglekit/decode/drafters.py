"""Drafters: what proposes tokens for the target to verify. One protocol (``Drafter``), three kinds.

* ``PlainDrafter`` proposes nothing (plain autoregressive decoding, the baseline).
* ``ModelDrafter`` samples a chain of ``gamma`` tokens from a small model with the same tokenizer
  (classic speculative decoding; verified with Leviathan's rule).
* ``TreeDrafter`` grows an EAGLE-2 dynamic tree from a proposer (one-hot rule): ``EagleDrafter`` with
  an EAGLE-1/EAGLE-3 head, ``ModelTreeDrafter`` with a draft model. ``lookup.LookupDrafter`` wraps any
  tree drafter with a prompt-lookup branch.
"""
from __future__ import annotations

import copy
from typing import Protocol

import torch

from eaglekit.decode.proposers import HeadProposer, ModelProposer, catch_up
from eaglekit.decode.sampling import Sampling, sample
from eaglekit.decode.tree import Tree, TreeSpec, expand


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

    kind: str | None
    layer_ids: tuple | None

    def prefill(self, prompt: torch.Tensor, out, root: int) -> None: ...

    def draft(self, max_depth: int) -> Tree: ...

    def commit(self, tree: Tree, path: list[int], next_token: int, out, rows: torch.Tensor) -> None: ...


class PlainDrafter:
    kind, layer_ids = None, ()

    def prefill(self, prompt, out, root):
        pass

    def draft(self, max_depth: int) -> Tree:
        return Tree.empty()

    def commit(self, tree, path, next_token, out, rows):
        pass

    def fork(self) -> PlainDrafter:
        return PlainDrafter()


class ModelDrafter:
    """Classic speculative decoding: a chain of ``gamma`` tokens sampled from a small draft model (the same
    ``ModelProposer`` as a draft-model tree: its cache, its logits over the target's ids)."""

    kind, layer_ids = None, ()

    def __init__(self, target, draft, gamma: int, sampling: Sampling, generator=None):
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.proposer = ModelProposer(target, draft)
        self.gamma, self.sampling, self.generator = gamma, sampling, generator

    def fork(self) -> ModelDrafter:
        """Another sequence's drafter: the proposer's model shared, its cache not."""
        new = copy.copy(self)
        new.proposer = self.proposer.fork()
        return new

    def prefill(self, prompt, out, root):
        # the first draft forward reads the prompt and the root together (one draft forward fewer than a
        # separate prompt pass, as HF assisted generation does)
        self.proposer.start(prompt, out, root)

    def draft(self, max_depth: int) -> Tree:
        gamma = min(self.gamma, max_depth)
        self.drafted = gamma
        if gamma == 0:
            return Tree.empty()
        p, qs, toks = self.proposer, [], []
        for _ in range(gamma):
            q = self.sampling.probs(p.catch_up()[1])
            # greedy: the token stays on the device (no read per drafted token)
            y = q.argmax() if self.sampling.greedy else torch.tensor(sample(q, self.generator), device=q.device)
            qs.append(q)
            toks.append(y)
            p.pending = y.view(1)
        p.pending = p.pending[:0]  # the last token drafted is never fed
        q_full, tokens = torch.stack(qs), torch.stack(toks)
        q_tok = q_full.gather(1, tokens[:, None])[:, 0]
        return Tree.chain(tokens, q_tok, None if self.sampling.greedy else q_full, sampled=True)

    def commit(self, tree, path, next_token, out, rows):
        # the draft cache holds the chain's first gamma-1 tokens (the last was sampled, never fed)
        p = self.proposer
        fed = max(self.drafted - 1, 0)
        keep = min(len(path), fed)
        p.crop(p.length - (fed - keep))
        rest = torch.tensor(tree.path_tokens(path)[keep:] + [next_token], device=p.device)
        p.pending = torch.cat([p.pending, rest])


class TreeDrafter:
    """An EAGLE-2 dynamic tree grown by a proposer (``proposers.HeadProposer`` or ``ModelProposer``).

    Each draft first runs the tokens accepted since the last one through the proposer's cache, then
    expands the tree level by level above them (``tree.expand``) and crops the proposer's cache back to
    the accepted text. Candidates are chosen (top-k), so acceptance uses the one-hot rule, exact at any
    temperature.
    """

    def __init__(self, proposer, spec: TreeSpec):
        self.proposer, self.spec = proposer, spec
        self.kind, self.layer_ids = proposer.kind, proposer.layer_ids

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


class ModelTreeDrafter(TreeDrafter):
    """A draft model growing an EAGLE-2 dynamic tree instead of a chain (SpecInfer-style token tree).

    Each level is one draft-model forward over the ``top_k`` frontier nodes with a tree mask; on a CPU
    that costs about one token, so the extra branches are nearly free to draft. The draft cache is cropped
    after drafting and the accepted tokens re-fed in the next draft forward, like the head cache.
    ``decode.generate(target, ModelTreeDrafter(target, draft, TreeSpec(...)), ...)``.
    """

    def __init__(self, target, draft, spec: TreeSpec):
        super().__init__(ModelProposer(target, draft), spec)


def catch_up_rows(drafters: list) -> None:
    """Before drafting, the rows drafting with an EAGLE head (``TreeDrafter``s, bare or under a
    ``LookupDrafter``) run their pending elements in: the rows of each head in one head forward
    (``proposers.catch_up``). Other drafters catch up in their own ``draft``."""
    rows = [p for d in drafters if isinstance(p := getattr(getattr(d, "inner", d), "proposer", None), HeadProposer)
            and p.caught is None]
    if rows:
        catch_up(rows)
