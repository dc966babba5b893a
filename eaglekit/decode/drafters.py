"""Drafters: what proposes tokens for the target to verify. One protocol, three kinds.

* ``PlainDrafter`` proposes nothing (plain autoregressive decoding, the baseline).
* ``ModelDrafter`` samples a chain of ``gamma`` tokens from a small model with the same tokenizer
  (classic speculative decoding; verified with Leviathan's rule).
* ``EagleDrafter`` grows an EAGLE-2 dynamic tree with an EAGLE-1/EAGLE-3 head (one-hot rule).

Protocol: ``kind`` (which target taps the verify forward needs), ``prefill(prompt, out, root)`` after
the target's prefill, ``draft(max_depth) -> Tree`` below the current root, and
``commit(tree, path, next_token, out, rows)`` after acceptance (``rows`` = verify rows of root + accepted
nodes, whose target features ``out`` holds).
"""
from __future__ import annotations

import weakref

import torch

from eaglekit.decode import kv
from eaglekit.decode.sampling import Sampling, sample
from eaglekit.decode.tree import Tree, TreeSpec, additive, select_best


class PlainDrafter:
    kind, layer_ids = None, None

    def prefill(self, prompt, out, root):
        pass

    def draft(self, max_depth: int) -> Tree:
        return Tree.empty()

    def commit(self, tree, path, next_token, out, rows):
        pass


# draft tokenizer -> target tokenizers it was found equal to: ``get_vocab()`` on two 152k vocabularies costs
# ~0.3 s, about 3% of a 64-token Qwen generate on the CPU, so each pair is compared once.
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


class ModelDrafter:
    """Classic speculative decoding: a chain of ``gamma`` tokens sampled from a small draft model."""

    kind, layer_ids = None, None

    def __init__(self, target, draft, gamma: int, sampling: Sampling, generator=None):
        check_same_tokenizer(target, draft)
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.draft_model, self.gamma, self.sampling, self.generator = draft, gamma, sampling, generator
        self.vocab = target.vocab_size

    def prefill(self, prompt, out, root):
        self.cache = kv.new_cache(self.draft_model.model)
        # tokens the draft model has not seen yet: the first draft forward reads the prompt and the root
        # together (one draft forward fewer than a separate prompt pass, as HF assisted generation does)
        self.pending = prompt[0].tolist() + [root]

    def _next(self, ids: list[int]) -> torch.Tensor:
        dev = self.draft_model.device
        x = torch.tensor([ids], device=dev)
        out = self.draft_model.forward(x, past_key_values=self.cache, kind=None, logits_to_keep=1)
        logits = out.logits[0, -1]
        q = self.sampling.probs(logits)
        if q.shape[-1] != self.vocab:  # same tokenizer, different lm_head padding
            q = torch.nn.functional.pad(q, (0, self.vocab - q.shape[-1])) if q.shape[-1] < self.vocab \
                else q[: self.vocab] / q[: self.vocab].sum()
        return q

    def draft(self, max_depth: int) -> Tree:
        gamma = min(self.gamma, max_depth)
        self.drafted = gamma
        if gamma == 0:
            return Tree.empty()
        qs, toks, ids = [], [], self.pending
        for i in range(gamma):
            q = self._next(ids)
            y = int(q.argmax()) if self.sampling.greedy else sample(q, self.generator)
            qs.append(q)
            toks.append(y)
            ids = [y]
        self.pending = []
        q_full = torch.stack(qs)
        tokens = torch.tensor(toks, device=q_full.device)
        q_tok = q_full.gather(1, tokens[:, None])[:, 0]
        return Tree.chain(tokens, q_tok, None if self.sampling.greedy else q_full, sampled=True)

    def commit(self, tree, path, next_token, out, rows):
        # the draft cache holds the chain's first gamma-1 tokens (the last was sampled, never fed)
        fed = max(self.drafted - 1, 0)
        keep = min(len(path), fed)
        kv.crop(self.cache, kv.cache_length(self.cache) - (fed - keep))
        accepted = tree.tokens[path].tolist() if path else []
        self.pending = self.pending + accepted[keep:] + [next_token]


class EagleDrafter:
    """EAGLE-2 dynamic tree from an EAGLE-1/EAGLE-3 head that keeps its own ``HeadCache``.

    The head's element t is (feature g_t, token x_{t+1}) at position t. Accepted tokens are fed back with
    the *target's* features from the verify forward (the tree's own elements, drafted from the head's
    predicted features, are cropped away after drafting), so the head cache only ever holds exact
    elements; the target's cache is never re-run.
    """

    def __init__(self, target, head, spec: TreeSpec):
        from eaglekit.heads import HeadCache, check_target

        check_target(head.config, target, where="decode.generate")
        self.head, self.spec, self.kind = head, spec, head.config.kind
        self.layer_ids = tuple(head.config.aux_layer_ids) or None
        self.HeadCache = HeadCache
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype

    def _features(self, out, rows) -> torch.Tensor:
        feats = out.aux if self.kind == "eagle3" else out.last
        return feats[0, rows].to(self.device, self.dtype)

    def prefill(self, prompt, out, root):
        self.cache = self.HeadCache()
        self.committed = 0
        ids = prompt[0, 1:].tolist() + [root]
        self.pending_ids = torch.tensor(ids, device=self.device)
        self.pending_g = self.head.fuse(self._features(out, torch.arange(prompt.shape[1])))

    def commit(self, tree, path, next_token, out, rows):
        ids = (tree.tokens[path].tolist() if path else []) + [next_token]
        self.pending_ids = torch.tensor(ids, device=self.device)
        self.pending_g = self.head.fuse(self._features(out, rows.to(out.last.device)))

    @torch.no_grad()
    def draft(self, max_depth: int) -> Tree:
        n = len(self.pending_ids)
        pos = torch.arange(self.committed, self.committed + n, device=self.device)
        g = None if self.pending_g is None else self.pending_g[None]
        hidden, logits = self.head.step(self.pending_ids[None], g, pos[None], cache=self.cache)
        self.committed += n
        depth = min(self.spec.depth, max_depth)
        if depth == 0:
            return Tree.empty(self.device)
        tree = self._expand(hidden[0, -1], logits[0, -1], depth)
        self.cache.crop(self.committed)
        return tree

    def _expand(self, root_hidden, root_logits, depth: int) -> Tree:
        """EAGLE-2: expand the ``top_k`` best frontier nodes by their ``top_k`` children for ``depth``
        levels (score = log path probability); keep the best ``total_tokens`` of all candidates."""
        k = min(self.spec.top_k, root_logits.shape[-1])
        top = torch.log_softmax(root_logits.float(), -1).topk(k)
        # the candidate pool (all levels; pool order = parents before children), bookkept on the CPU
        tokens, logq = [top.indices.cpu()], [top.values.cpu()]
        parents, depths, scores = [torch.full((k,), -1)], [torch.ones(k, dtype=torch.long)], [logq[0]]
        frontier = torch.arange(k)  # pool indices expanded at the next level
        feed = root_hidden.expand(k, -1)  # a node's element takes its parent's output as g
        slots: dict[int, int] = {}  # pool index -> head cache slot of the node's element
        for d in range(2, depth + 1):
            pool_tokens, pool_parents = torch.cat(tokens), torch.cat(parents)
            ids = self.head.draft_to_target(pool_tokens[frontier].to(self.device))
            pos = torch.full((len(frontier),), self.committed - 1 + d - 1, device=self.device)
            mask = self._level_mask(frontier, pool_parents, slots)
            for i, f in enumerate(frontier.tolist()):
                slots[f] = self.cache.length + i
            hidden, lg = self.head.step(ids[None], feed[None], pos[None], cache=self.cache, attn_mask=mask)
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
            feed = hidden[0][(best // k).to(self.device)]
        kept, new_parents = select_best(torch.cat(scores), torch.cat(parents), self.spec.total_tokens)
        draft_ids = torch.cat(tokens)[kept].to(self.device)
        return Tree(tokens=self.head.draft_to_target(draft_ids).long(), parents=new_parents.to(self.device),
                    depths=torch.cat(depths)[kept].to(self.device), q_token=torch.cat(logq)[kept].exp())

    def _level_mask(self, frontier, pool_parents, slots) -> torch.Tensor:
        """Frontier elements see every committed element, their ancestors' elements and themselves."""
        kf, before = len(frontier), self.cache.length
        allowed = torch.zeros(kf, before + kf, dtype=torch.bool)
        allowed[:, : self.committed] = True
        for i, f in enumerate(frontier.tolist()):
            allowed[i, before + i] = True
            a = int(pool_parents[f])
            while a >= 0:
                allowed[i, slots[a]] = True
                a = int(pool_parents[a])
        return additive(allowed.to(self.device), self.dtype)[None, None]


class _ModelCache:
    """A draft model's ``DynamicCache`` behind the two calls the tree expansion makes (``length``, ``crop``)."""

    def __init__(self, model):
        self.dyn = kv.new_cache(model)

    @property
    def length(self) -> int:
        return kv.cache_length(self.dyn)

    def crop(self, n: int) -> None:
        kv.crop(self.dyn, n)


class _ModelAsHead:
    """A draft Target driven like a head by the tree expansion: ``step`` = one draft-model forward over the
    given tokens (tree mask and positions given) on its own cache. It reads no features: the ``hidden`` it
    returns is an empty placeholder for the feature slot the expansion carries."""

    def __init__(self, draft, vocab: int):
        self.draft, self.vocab = draft, vocab

    def step(self, ids, g, pos, cache: _ModelCache, attn_mask=None):
        keep = 1 if attn_mask is None else 0  # the pending tokens (a whole prompt at first): last row only
        out = self.draft.forward(ids, attention_mask=attn_mask, position_ids=pos, past_key_values=cache.dyn,
                                 kind=None, logits_to_keep=keep)
        logits = out.logits[..., : self.vocab]  # a draft lm_head padded past the target's vocab: never propose those
        return logits.new_zeros(logits.shape[:2] + (1,)), logits

    @staticmethod
    def draft_to_target(ids: torch.Tensor) -> torch.Tensor:
        return ids


class ModelTreeDrafter(EagleDrafter):
    """A draft model growing an EAGLE-2 dynamic tree instead of a chain (SpecInfer-style token tree).

    Each level is one draft-model forward over the ``top_k`` frontier nodes with a tree mask; on a CPU
    that costs about one token, so the extra branches are nearly free to draft. Candidates are chosen
    (top-k), so acceptance uses the one-hot rule, exact at any temperature. The draft cache is cropped
    after drafting and the accepted tokens re-fed in the next draft forward, like the head cache.
    ``decode.generate(target, ModelTreeDrafter(target, draft, TreeSpec(...)), ...)``.
    """

    kind, layer_ids = None, None

    def __init__(self, target, draft, spec: TreeSpec):
        check_same_tokenizer(target, draft)
        self.draft_model, self.head, self.spec = draft, _ModelAsHead(draft, target.vocab_size), spec
        self.device, self.dtype = draft.device, draft.dtype

    def prefill(self, prompt, out, root):
        self.cache = _ModelCache(self.draft_model.model)
        self.committed = 0
        self.pending_ids = torch.tensor(prompt[0].tolist() + [root], device=self.device)
        self.pending_g = None

    def commit(self, tree, path, next_token, out, rows):
        ids = (tree.tokens[path].tolist() if path else []) + [next_token]
        self.pending_ids = torch.tensor(ids, device=self.device)
