"""Prompt lookup grafted onto any draft tree: text that repeats its context gets a long branch for free.

A head proposes what the target would say next; an n-gram match in the context (the prompt and the
answer so far) proposes text the answer is copying (a quoted passage, a variable name, a list's shape).
The two fail in different places, so ``LookupDrafter`` verifies both in the same forward: the tokens that
followed the latest earlier occurrence of the context's last n-gram become one extra chain below the
root, sharing the nodes the inner drafter already proposed. Every node is a chosen (not sampled) token,
so the one-hot acceptance rule stays exact at any temperature; the inner drafter's commit sees accepted
nodes with the target's features wherever they came from. ``decode.generate(..., prompt_lookup=N)``.
"""
from __future__ import annotations

import torch

from eaglekit.decode.draft_model import ModelDrafter
from eaglekit.decode.drafters import PlainDrafter, Tree, prune

SAMPLED = ("prompt lookup grafts onto a tree of chosen tokens; a draft-model chain is sampled (Leviathan's "
           "rule): use a draft-model tree (draft_tree= / ModelTreeDrafter) instead")


class NgramIndex:
    """The context's n-grams (``min_ngram``..``max_ngram`` tokens) -> where their latest occurrence ends,
    kept up to date as the context grows (O(new tokens) per step, not a scan of the whole context)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self.ends: dict[tuple, int] = {}  # n-grams ending before the last token: the tail never finds itself

    def extend(self, tokens: list[int]) -> None:
        seq, start = self.tokens, max(len(self.tokens), 1)
        seq += tokens
        for end in range(start, len(seq)):  # n-grams ending at end - 1, now that end is no longer the tail
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.ends[tuple(seq[end - n:end])] = end

    def match(self) -> tuple[int, int]:
        """(n, end): the longest n whose last n-gram occurred earlier, and where that occurrence ends;
        (0, 0) when nothing matches."""
        seq = self.tokens
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            end = self.ends.get(tuple(seq[-n:]))
            if end is not None:
                return n, end
        return 0, 0

    def continuation(self, max_tokens) -> tuple[int, list[int]]:
        """(n, tokens): the length n of the longest tail n-gram that occurred earlier, and up to ``max_tokens``
        tokens (an int, or one per match length from ``min_ngram`` up) that followed its latest earlier
        occurrence; (0, []) when nothing matches. A continuation that runs into the tail repeats with its
        period (a run of spaces, ``1 2 1 2``) instead of stopping at the end of the context."""
        n, end = self.match()
        if not n:
            return 0, []
        return n, self.follow(end, max_tokens if isinstance(max_tokens, int) else max_tokens[n - self.min_ngram])

    def follow(self, end: int, k: int) -> list[int]:
        """The ``k`` tokens from ``end`` on, repeating with the period where they run into the tail."""
        seq, period = self.tokens, len(self.tokens) - end
        return [seq[end + i % period] for i in range(k)]


def graft_chain(tree: Tree, chain: list[int]) -> Tree:
    """``tree`` plus ``chain`` hung below the root; the chain's leading tokens that are already a path of
    the tree reuse those nodes (a node's children stay distinct tokens, as the acceptance rule needs)."""
    if tree.sampled:
        raise ValueError(SAMPLED)
    if not chain:
        return tree
    tokens, parents, depths = tree.host()
    node, i = -1, 0
    while i < len(chain):
        child = next((c for c, (p, t) in enumerate(zip(parents, tokens)) if p == node and t == chain[i]), None)
        if child is None:
            break
        node, i = child, i + 1
    rest = chain[i:]
    if not rest:
        return tree
    n, top = len(tokens), depths[node] if node >= 0 else 0
    like = {"device": tree.tokens.device, "dtype": tree.tokens.dtype}
    return Tree(tokens=torch.cat([tree.tokens, torch.tensor(rest, **like)]),
                parents=torch.cat([tree.parents, torch.tensor([node] + list(range(n, n + len(rest) - 1)), **like)]),
                depths=torch.cat([tree.depths, torch.arange(top + 1, top + 1 + len(rest), **like)]),
                q_token=torch.cat([tree.q_token, tree.q_token.new_ones(len(rest))]))


# Branch length after a 1-, 2- and 3-gram match: a longer match's continuation is accepted further, and
# every verified row past a few costs time on a CPU, so short matches get short branches. Tuned on a 2-core
# CPU with an EAGLE-3 head on SmolLM2 (benchmarks/bench_lookup_lengths.py; the figures are in
# benchmarks/RESULTS.md, "Prompt lookup").
BY_MATCH = (2, 5, 10)


def branch_lengths(tokens, max_ngram: int = 3, min_ngram: int = 1) -> tuple[int, ...]:
    """``tokens`` (an int for every match length, a sequence with one per length from ``min_ngram`` to
    ``max_ngram``, or the string "2,5,10") as one length per match length, checked."""
    NgramIndex(max_ngram, min_ngram)  # checks the n-gram sizes
    if isinstance(tokens, str):
        try:
            tokens = [int(x) for x in tokens.split(",")]
        except ValueError:
            raise ValueError(f"prompt lookup tokens {tokens!r}: expected an int or 'n1,n2,...'") from None
    count = max_ngram - min_ngram + 1
    lengths = (int(tokens),) * count if isinstance(tokens, int) else tuple(int(t) for t in tokens)
    if len(lengths) != count or min(lengths) < 0 or max(lengths) < 1:
        raise ValueError(f"prompt lookup needs tokens >= 1, or {count} lengths >= 0 (one per match of "
                         f"{min_ngram}..{max_ngram} tokens, not all 0), got {tokens!r}")
    return lengths


class LookupDrafter:
    """Wrap a tree drafter (``EagleDrafter``, ``ModelTreeDrafter``, ``PlainDrafter`` or None for plain) with
    a prompt-lookup branch from an n-gram of ``max_ngram`` down to ``min_ngram`` tokens: ``tokens`` long
    (an int), or ``tokens[n - min_ngram]`` long after an n-token match (a sequence, e.g. ``BY_MATCH``).
    ``inner_nodes``: on steps with a branch, keep only the inner tree's best ``inner_nodes`` nodes (where
    verification cost grows with the rows, the branch's rows are worth more than the head's unlikely
    candidates; ``tree="auto"`` sets it from the measured costs)."""

    def __init__(self, inner, tokens, max_ngram: int = 3, min_ngram: int = 1, inner_nodes: int | None = None):
        if isinstance(inner, ModelDrafter):
            raise ValueError(SAMPLED)  # noqa: TRY004 (a sampled drafter is a wrong value for a graft, as callers catch)
        self.lengths = branch_lengths(tokens, max_ngram, min_ngram)
        if inner_nodes is not None and inner_nodes < 0:
            raise ValueError(f"inner_nodes must be >= 0 or None, got {inner_nodes}")
        self.inner_nodes = inner_nodes
        inner = PlainDrafter() if inner is None else inner
        self.inner, self.max_ngram, self.min_ngram = inner, max_ngram, min_ngram
        self.layer_ids = inner.layer_ids
        self.matches = self.accepted = 0  # since construction: drafts with a continuation, lookup nodes accepted
        # match length n -> {k: steps whose accepted path began with k of the branch's tokens}, since construction
        self.accepted_by_match: dict[int, dict[int, int]] = {}

    def fork(self) -> LookupDrafter:
        """Another sequence's drafter: same branch lengths, the inner drafter forked, its own counters."""
        return LookupDrafter(self.inner.fork(), self.lengths, self.max_ngram, self.min_ngram, self.inner_nodes)

    def prefill(self, prompt, out, root):
        self.context = NgramIndex(self.max_ngram, self.min_ngram)
        self.context.extend(prompt[0].tolist() + [root])
        self.inner.prefill(prompt, out, root)

    def draft(self, max_depth: int) -> Tree:
        tree = self.inner.draft(max_depth)  # graft_chain refuses a sampled tree
        n, chain = self.context.continuation(self.lengths)
        chain = chain[:max_depth]
        self.branch = n, chain
        if chain and self.inner_nodes is not None:
            tree = prune(tree, self.inner_nodes)
        self.matches += bool(chain)
        self.first_grafted = len(tree)  # grafted nodes come after the inner drafter's
        return graft_chain(tree, chain)

    def commit(self, tree, path, next_token, out, rows):
        self.accepted += sum(1 for node in path if node >= self.first_grafted)
        accepted = tree.path_tokens(path)
        n, chain = self.branch
        if chain:
            k = 0
            for token, proposed in zip(accepted, chain):
                if token != proposed:
                    break
                k += 1
            counts = self.accepted_by_match.setdefault(n, {})
            counts[k] = counts.get(k, 0) + 1
        self.context.extend(accepted + [next_token])
        self.inner.commit(tree, path, next_token, out, rows)
