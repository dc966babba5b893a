"""A draft model as a drafter: another causal LM sharing the target's tokenizer, on its own KV cache.

* ``ModelDrafter`` samples a chain of ``gamma`` tokens (classic speculative decoding; verified with
  Leviathan's rule, ``loop.accept_sampled``).
* ``ModelTreeDrafter`` grows an EAGLE-2 dynamic tree from the same model (SpecInfer-style token tree;
  verified with the one-hot rule).

Both draft through one ``ModelProposer`` (its cache, its logits over the target's ids); the tree machinery
(``TreeDrafter``, ``expand``) is the heads' own, in drafters.py.
"""
from __future__ import annotations

import copy
import weakref

import torch

from eaglekit.decode.drafters import Tree, TreeDrafter, TreeSpec
from eaglekit.decode.loop import Sampling, sample
from eaglekit.target import cache_length, crop_cache, new_cache

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
    """A draft model sharing the target's tokenizer, on its own cache (``new_cache``): element t is token t at
    position t. It reads no target features, and feeds none to its children."""

    layer_ids = ()

    def __init__(self, target, draft):
        check_same_tokenizer(target, draft)
        self.model, self.vocab = draft, target.vocab_size
        self.device, self.dtype = draft.device, draft.dtype

    def fork(self) -> ModelProposer:
        return copy.copy(self)  # start() replaces the per-sequence state a copy shares

    def start(self, prompt, out, root: int) -> None:
        self.cache = new_cache(self.model.model)
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
        return cache_length(self.cache)

    def crop(self, n: int) -> None:
        crop_cache(self.cache, n)


class ModelDrafter:
    """Classic speculative decoding: a chain of ``gamma`` tokens sampled from a small draft model (the same
    ``ModelProposer`` as a draft-model tree: its cache, its logits over the target's ids)."""

    layer_ids = ()

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


class ModelTreeDrafter(TreeDrafter):
    """A draft model growing an EAGLE-2 dynamic tree instead of a chain (SpecInfer-style token tree).

    Each level is one draft-model forward over the ``top_k`` frontier nodes with a tree mask; on a CPU
    that costs about one token, so the extra branches are nearly free to draft. The draft cache is cropped
    after drafting and the accepted tokens re-fed in the next draft forward, like the head cache.
    ``decode.generate(target, ModelTreeDrafter(target, draft, TreeSpec(...)), ...)``.
    """

    def __init__(self, target, draft, spec: TreeSpec):
        super().__init__(ModelProposer(target, draft), spec)
