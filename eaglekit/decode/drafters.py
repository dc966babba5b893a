"""Drafters: what proposes tokens for the target to verify. One protocol (``Drafter``), three kinds, and the
proposers that grow their trees.

* ``PlainDrafter`` proposes nothing (plain autoregressive decoding, the baseline).
* ``ModelDrafter`` samples a chain of ``gamma`` tokens from a small model with the same tokenizer
  (classic speculative decoding; verified with Leviathan's rule).
* ``TreeDrafter`` grows an EAGLE-2 dynamic tree from a proposer (one-hot rule): ``EagleDrafter`` with
  an EAGLE-1/EAGLE-3 head, ``ModelTreeDrafter`` with a draft model. ``lookup.LookupDrafter`` wraps any
  tree drafter with a prompt-lookup branch.

A proposer (``HeadProposer``, ``ModelProposer``) is what ``tree.expand`` grows a tree from, on its own cache:
*committed* elements there (the accepted text, exactly), *pending* ones (the last accepted tokens, not yet
run). ``start(prompt, out, root)`` after the target's prefill (``out`` its ``TargetOutput``) and
``accept(tokens, out, rows)`` after each verify set the pending tokens, with the target's features at verify
rows ``rows`` (a proposer that reads none ignores ``out``); ``catch_up() -> (hidden, logits)`` runs them in
and returns the last one's output (``hidden`` None for a proposer that feeds no feature to its children);
``step(ids, feed, pos, mask)`` runs [1, S] tokens above the committed ones under a tree mask; ``to_target``,
``length``, ``crop(n)``; ``layer_ids`` the target layers ``accept`` reads (``()``: none); ``fork()`` a
proposer for another sequence sharing the model. ``catch_up(proposers)`` runs the pending elements of every
row of one head in one head forward (one row is a batch of one); a draft model's rows catch up alone.
"""
from __future__ import annotations

import copy
import weakref
from typing import Protocol

import torch

from eaglekit.decode import kv
from eaglekit.decode.sampling import Sampling, sample
from eaglekit.decode.tree import Tree, TreeSpec, expand
from eaglekit.heads import check_target
from eaglekit.heads.layers import HeadRows, RowsStep


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
        self.head, self.kind = head, head.config.kind
        # the target layers this head reads, exactly (() for EAGLE-1): what the verify forward taps
        self.layer_ids = type(head).tap_layers(target, head.config.aux_layer_ids)
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype

    def _features(self, out, rows: torch.Tensor) -> torch.Tensor:
        return self.head.fuse_output(kv.row_output(out, 0, rows, self.device))[0]

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


# draft tokenizer -> target tokenizers it was found equal to: ``get_vocab()`` on two large vocabularies is a
# noticeable share of a short generate, so each pair is compared once.
_SAME_TOKENIZER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_same_tokenizer(target, draft) -> None:
    """A draft model must speak the target's vocabulary (same token strings at the same ids)."""
    checked = _SAME_TOKENIZER.setdefault(draft.tokenizer, weakref.WeakSet())
    if target.tokenizer in checked:
        return
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv == dv:
        checked.add(target.tokenizer)
        return
    t_inv = {i: s for s, i in tv.items()}
    d_inv = {i: s for s, i in dv.items()}
    diff = [i for i in sorted(set(t_inv) | set(d_inv)) if t_inv.get(i) != d_inv.get(i)]
    shown = ", ".join(f"id {i}: target {t_inv.get(i)!r} vs draft {d_inv.get(i)!r}" for i in diff[:3])
    raise ValueError(f"draft model {draft.name!r} does not share the tokenizer of target {target.name!r}: "
                     f"vocab sizes {len(tv)} vs {len(dv)}, {len(diff)} ids differ ({shown})")


class ModelProposer:
    """A draft model sharing the target's tokenizer, on its own cache (``kv.new_cache``): element t is token t at
    position t. It reads no target features, and feeds none to its children."""

    kind, layer_ids = None, ()

    def __init__(self, target, draft):
        check_same_tokenizer(target, draft)
        self.model, self.vocab = draft, target.vocab_size
        self.device, self.dtype = draft.device, draft.dtype

    def fork(self) -> ModelProposer:
        return copy.copy(self)  # start() replaces the per-sequence state a copy shares

    def start(self, prompt, out, root: int) -> None:
        self.cache = kv.new_cache(self.model.model)
        self.pending = torch.tensor(prompt[0].tolist() + [root], device=self.device)

    def accept(self, tokens: list[int], out, rows) -> None:
        self.pending = torch.tensor(tokens, device=self.device)

    def catch_up(self):
        """Run the pending tokens in; the last one's logits (over the target's ids)."""
        pos = torch.arange(self.length, self.length + len(self.pending), device=self.device)
        _, logits = self.step(self.pending[None], None, pos[None], None)
        return None, logits[0, -1]

    def step(self, ids, feed, pos, mask):
        keep = 1 if mask is None else 0  # the pending tokens (a whole prompt at first): last row only
        out = self.model.forward(ids, attention_mask=mask, position_ids=pos, past_key_values=self.cache,
                                 layer_ids=(), logits_to_keep=keep)
        return None, self.target_vocab(out.logits)

    def target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the target's ids: a draft lm_head padded past the target's vocabulary never proposes
        those ids (cut), a shorter one never proposes the ids it lacks (-inf)."""
        short = self.vocab - logits.shape[-1]
        if short <= 0:
            return logits[..., : self.vocab]
        return torch.nn.functional.pad(logits, (0, short), value=float("-inf"))

    @staticmethod
    def to_target(ids: torch.Tensor) -> torch.Tensor:
        return ids

    @property
    def length(self) -> int:
        return kv.cache_length(self.cache)

    def crop(self, n: int) -> None:
        kv.crop(self.cache, n)


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
        # draft() leaves nothing pending (its last token is never fed) unless it drafted nothing
        p.pending = torch.cat([p.pending, rest]) if len(p.pending) else rest


class TreeDrafter:
    """An EAGLE-2 dynamic tree grown by a proposer (``HeadProposer`` or ``ModelProposer``).

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
    (``catch_up``). Other drafters catch up in their own ``draft``."""
    rows = [p for d in drafters if isinstance(p := getattr(getattr(d, "inner", d), "proposer", None), HeadProposer)
            and p.caught is None]
    if rows:
        catch_up(rows)
