"""Proposers: what grows a draft tree (``tree.expand``), an EAGLE head or a draft model, each on its own cache.

A proposer holds *committed* elements (the accepted text, exactly) in its cache and *pending* ones (the
last accepted tokens, not yet run). ``TreeDrafter`` drives it:

* ``start(prompt, out, root)`` after the target's prefill (``out`` = its ``TargetOutput``), and
  ``accept(tokens, out, rows)`` after each verify: the tokens pending next, with the target's
  features at verify rows ``rows`` (a proposer that reads none ignores ``out``);
* ``catch_up() -> (hidden, logits)`` runs the pending elements into the cache, returning the last
  one's output (``hidden`` None for a proposer that feeds no feature to its children);
* ``step(ids, feed, pos, mask)`` [1, S] tokens above the committed ones under a tree mask,
  ``to_target(ids)``, ``length`` and ``crop(n)``: what ``tree.expand`` calls;
* ``layer_ids``: the target layers the verify forward must tap for ``accept`` (``()``: none);
* ``fork()``: a proposer for another sequence, sharing the model (``start`` gives it its own cache).

``catch_up(proposers)`` runs the pending elements of every row of one head in one head forward (one row is
a batch of one); a draft model's rows catch up in their own ``catch_up``.
"""
from __future__ import annotations

import copy
import weakref

import torch

from eaglekit.decode import kv
from eaglekit.heads import check_target
from eaglekit.heads.cache import HeadRows, RowsStep


class HeadProposer:
    """An EAGLE-1/EAGLE-3 head with its own ``HeadCache``.

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
    """A draft model sharing the target's tokenizer, on its own ``DynamicCache``: element t is token t at
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
