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
from eaglekit.heads import HeadCache, check_target


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
        self.cache, self.caught = HeadCache(), None
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


@torch.no_grad()
def catch_up(proposers: list[HeadProposer]) -> None:
    """Run the rows' pending elements (rows of one head) through one head forward; each row's next
    ``HeadProposer.catch_up`` returns its last element's output. One row runs on its own cache, causally.
    Several: each row's cache left-padded to the longest and its pending elements right-padded, under a mask
    that lets row b see only its own cache and elements; each row then gets its new cache entries and the
    output it would have computed alone (up to float rounding: the sums run over padded lengths)."""
    if len(proposers) == 1:
        p = proposers[0]
        ids, g = p.pending
        pos = torch.arange(p.length, p.length + len(ids), device=p.device)
        hidden, logits = p.head.step(ids[None], g[None], pos[None], cache=p.cache)
        p.caught = hidden[0, -1], logits[0, -1]
        return
    head, first = proposers[0].head, proposers[0]
    cfg, dev, dtype = head.config, first.device, first.dtype
    lengths, counts = [p.length for p in proposers], [len(p.pending[0]) for p in proposers]
    T, P, B = max(lengths), max(counts), len(proposers)
    ids = torch.zeros(B, P, dtype=torch.long, device=dev)
    g = torch.zeros(B, P, cfg.hidden_size, dtype=dtype, device=dev)
    pos = torch.zeros(B, P, dtype=torch.long)
    allowed = torch.zeros(B, P, T + P, dtype=torch.bool)
    allowed[:, :, T:] = torch.eye(P, dtype=torch.bool)  # a padding element sees itself only
    for b, (p, length, n) in enumerate(zip(proposers, lengths, counts)):
        ids[b, :n], g[b, :n] = p.pending[0], p.pending[1]
        pos[b] = length + torch.arange(P).clamp_max(max(n - 1, 0))
        allowed[b, :n, T - length:T] = True
        allowed[b, :n, T:T + n] = torch.ones(n, n, dtype=torch.bool).tril()
    cache = HeadCache()
    for layer in range(cfg.num_layers):
        for name in ("keys", "values"):
            rows = [_left_pad(getattr(p.cache, name), layer, T, cfg, dtype, dev) for p in proposers]
            getattr(cache, name).append(torch.cat(rows) if T else None)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    hidden, logits = head.step(ids, g, pos.to(dev), cache=cache, attn_mask=mask[:, None].to(dev))
    for b, (p, n) in enumerate(zip(proposers, counts)):
        for layer in range(cfg.num_layers):
            p.cache.update(layer, cache.keys[layer][b:b + 1, :, T:T + n], cache.values[layer][b:b + 1, :, T:T + n])
        p.caught = hidden[b, n - 1], logits[b, n - 1]


def _left_pad(tensors: list, layer: int, width: int, cfg, dtype, dev) -> torch.Tensor | None:
    """A row's cached [1, kv_heads, L, head_dim] for ``layer``, zero-padded on the left to ``width``."""
    t = tensors[layer] if layer < len(tensors) else None
    have = 0 if t is None else t.shape[2]
    pad = torch.zeros(1, cfg.num_key_value_heads, width - have, cfg.head_dim, dtype=dtype, device=dev)
    return pad if t is None else torch.cat([pad, t], dim=2)


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
