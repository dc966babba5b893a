"""EAGLE-3 head (Li et al. 2025): fused low/mid/high taps, one wide decoder layer, its own draft lm_head.

What makes it EAGLE-3, all here: it reads the concatenated inputs of its tap layers (the target's
default taps unless given), fuses them with ``fc``, predicts over a draft vocabulary (``d2t``/``t2d``)
and trains on the soft cross-entropy alone; it can start its lm_head and norm from the target's.

EAGLE 3.1's two options (both off by default; a head without them runs exactly the EAGLE-3 path):
``fc_norm`` puts an RMSNorm on each tap before ``fc`` (``fc_norm.{i}``, as vLLM / SGLang / speculators
name them; ``norm_before_fc`` is the alternative llama.cpp serves: one RMSNorm over the concatenated taps,
``input_norm``), and ``norm_output`` makes ``step`` return the post-norm hidden state — the feature the next
draft step reads, in training's unroll and in decoding's tree alike — instead of the pre-norm one.

P-EAGLE (``PEagleHead``, at the end) is this network drafting a whole block in one forward: it shares
EAGLE-3's layers, fusion, step and warm starts, and adds the mask slots and its block objective.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from eaglekit.heads.base import DraftHead, ParallelHead
from eaglekit.heads.config import EAGLE3, PEAGLE, HeadConfig
from eaglekit.heads.layers import MLP, Attention, DecoderLayer, HeadCache, RMSNorm, shift_left
from eaglekit.heads.objectives import StepStats, TeacherRows, position_loss
from eaglekit.heads.ttt_attention import TTTCache


class Eagle3FirstLayer(nn.Module):
    """q/k/v read ``[input_layernorm(embed); hidden_norm(g)]`` (2H); the residual stream is g.

    ``norm_before_residual=True`` makes the residual ``hidden_norm(g)`` instead (vLLM's flag of that name).
    """

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        H = cfg.hidden_size
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, g, cos, sin, cache=None, mask=None):
        normed = self.hidden_norm(g)
        residual = normed if self.norm_before_residual else g
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = residual + self.self_attn(x, cos, sin, 0, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(DraftHead):
    kind = EAGLE3
    reads = "taps"
    has_draft_vocab = True
    # how the model card names it and the engines serve it (eaglekit.export.hub)
    display_name, vllm_method, sglang_algorithm = "EAGLE-3", "eagle3", "EAGLE3"
    speculators_model = ("speculators.models.eagle3", "Eagle3DraftModel")
    llama_cpp_spec_type = "draft-eagle3"

    def __init__(self, config: HeadConfig):
        if config.kind != EAGLE3:
            raise ValueError(f"Eagle3Head needs kind='eagle3', got {config.kind!r}")
        config.validate()
        super().__init__(config)
        H, taps = config.hidden_size, len(config.aux_layer_ids)
        if config.fc_norm:  # registered only when set: an EAGLE-3 head's state dict stays as it was
            self.fc_norm = nn.ModuleList([RMSNorm(H, config.rms_norm_eps) for _ in range(taps)])
        if config.norm_before_fc:  # speculators' and llama.cpp's name for it
            self.input_norm = RMSNorm(taps * H, config.rms_norm_eps)
        self.fc = nn.Linear(taps * H, H, bias=False)
        self.layers = nn.ModuleList([Eagle3FirstLayer(config)] +
                                    [DecoderLayer(config, i) for i in range(1, config.num_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        # until set_draft_vocab: the draft vocab is the first Vd target ids (zero offsets)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """[.., len(taps)*H] concatenated layer inputs → g [.., H] (each tap normed first under fc_norm:
        the taps' scales differ by layer, and a norm per tap lets none dominate g)."""
        taps = taps.to(self.fc.weight.dtype)
        if self.config.fc_norm:
            parts = taps.chunk(len(self.fc_norm), dim=-1)
            taps = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts)], dim=-1)
        elif self.config.norm_before_fc:  # one norm over all taps: the scale of the sum, not of each
            taps = self.input_norm(taps)
        return self.fc(taps)

    def step(self, input_ids, g, position_ids, cache: HeadCache | None = None, attn_mask=None, project=True):
        """One head pass over S (feature, next token) pairs → (hidden [B,S,H], logits [B,S,Vd]); hidden is
        the feature the next draft step reads: before the final norm, or after it under norm_output.
        ``project=False`` returns the lm_head's input instead of the logits (``loss.recompute_logits``)."""
        self._check_step(input_ids, g, position_ids, cache, attn_mask)
        dtype = self.dtype
        cos, sin = self.rotary(position_ids.to(self.device), dtype)
        mask = None if attn_mask is None else attn_mask.to(self.device, dtype)
        x = self.layers[0](self.embed(input_ids), g.to(dtype), cos, sin, cache, mask)
        for layer in self.layers[1:]:
            x = layer(x, cos, sin, cache, mask)
        normed = self.norm(x)
        return (normed if self.config.norm_output else x), self.lm_head(normed) if project else normed

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Warm start: lm_head = the target's rows for the draft vocabulary, norm = the target's final norm.
        The head then only has to learn to produce the target's pre-norm last hidden state, which
        shortens training a lot when data or compute is small (CPU)."""
        self.init_lm_head_from_target()
        norm_w = getattr(target.norm, "weight", None)
        if norm_w is not None and norm_w.shape == self.norm.weight.shape:
            self.norm.weight.copy_(norm_w.to(self.norm.weight))

    @torch.no_grad()
    def init_layer_from_target(self, target) -> None:
        """Warm start the first decoder layer from the target's last one (``head.init_layer_from_target``):
        attention and MLP as the target's, q/k/v's hidden half (the columns reading ``hidden_norm(g)``) from
        the target's q/k/v, the embedding half scaled down so the layer starts as the target's last layer
        applied to g. Only modules whose shapes match are copied (a target with q/k/v biases loses them)."""
        src, dst = target.layers[-1], self.layers[0]
        H = self.config.hidden_size
        for name in ("q_proj", "k_proj", "v_proj"):
            w, mine = getattr(src.self_attn, name).weight, getattr(dst.self_attn, name).weight
            if w.shape == (mine.shape[0], H):
                mine[:, H:].copy_(w.to(mine))
                mine[:, :H].mul_(0.1)
        pairs = [(src.self_attn.o_proj, dst.self_attn.o_proj), (src.mlp.gate_proj, dst.mlp.gate_proj),
                 (src.mlp.up_proj, dst.mlp.up_proj), (src.mlp.down_proj, dst.mlp.down_proj),
                 (src.input_layernorm, dst.hidden_norm), (src.input_layernorm, dst.input_layernorm),
                 (src.post_attention_layernorm, dst.post_attention_layernorm)]
        for a, b in pairs:
            if a.weight.shape == b.weight.shape:
                b.weight.copy_(a.weight.to(b.weight))

    def init_lm_head_from_target(self) -> None:
        """Start the draft lm_head from the target's rows for the draft vocabulary (optional warm start)."""
        w = self.target_module("lm_head").weight
        ids = torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
        with torch.no_grad():
            self.lm_head.weight.copy_(w[ids.to(w.device)].to(self.lm_head.weight))


# ---- P-EAGLE: the same network drafting a block in one forward ----------------------------------------
class PEagleHead(ParallelHead):
    """P-EAGLE head (Hui et al. 2026, arXiv 2602.01469): EAGLE-3's network drafting a whole block in one forward.

    What makes it P-EAGLE, all here: the network is EAGLE-3's (fused taps through ``fc``, the first layer
    reading ``[norm(embed); norm(g)]``, more plain decoder layers, a draft-vocabulary ``lm_head``), and a
    learned ``mask_hidden`` vector (the size of ``fc``'s input, i.e. of the concatenated taps) stands in for
    the target feature at the ``block_size - 1`` positions after the last accepted element, whose token is
    ``config.mask_token_id``. One causal forward over [pending elements; mask slots] gives the logits of
    the block's ``block_size`` depths: the last pending element's own output (depth 1, as EAGLE-3's) and
    each mask slot's (depths 2..block_size). The mask slots see every earlier element and the earlier slots
    of their own block, and sit at the positions of the elements they stand for (rotary ids t+1, t+2, ...).

    Training scores every anchor t at every depth (no down-sampling: the block is short on a CPU): depth 1
    is the causal pass over the real elements; depth k+1 is a mask element of anchor t at position t+k that
    sees the real elements <= t and the anchor's mask elements of depths 2..k+1 — ``ttt_mask``'s pattern,
    so one TTTCache carries the depths as it carries TTT's steps.
    """

    kind = PEAGLE
    reads = "taps"
    has_draft_vocab = True
    # the model card's name; vLLM serves P-EAGLE as method "eagle3" (its P-EAGLE architecture is an alias of the
    # EAGLE-3 drafter) with parallel_drafting, drafting the block in one forward. The method is written out:
    # without it an older vLLM takes the folder for a draft model and fails at start. SGLang has no P-EAGLE
    # loader (docs/exports.md)
    display_name, vllm_method, sglang_algorithm = "P-EAGLE", "eagle3", None
    vllm_options: ClassVar[dict] = {"parallel_drafting": True}
    speculators_model = ("speculators.models.peagle", "PEagleDraftModel")

    def __init__(self, config: HeadConfig):
        if config.kind != PEAGLE:
            raise ValueError(f"PEagleHead needs kind='peagle', got {config.kind!r}")
        config.validate()
        if config.fc_norm or config.norm_output or config.norm_before_fc:  # the engines' P-EAGLE configs carry none
            raise ValueError("PEagleHead: fc_norm / norm_output / norm_before_fc are not P-EAGLE options; leave "
                             "them off")
        if not 0 <= config.mask_token_id < config.target_vocab_size:
            raise ValueError(f"PEagleHead: mask_token_id {config.mask_token_id} must be a target token id in "
                             f"0..{config.target_vocab_size - 1} (HeadConfig.from_target picks one)")
        super().__init__(config)
        H, taps = config.hidden_size, len(config.aux_layer_ids)
        self.fc = nn.Linear(taps * H, H, bias=False)
        self.layers = nn.ModuleList([Eagle3FirstLayer(config)] +
                                    [DecoderLayer(config, i) for i in range(1, config.num_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        # the taps of a position the target has not run yet (speculators and vLLM: ``mask_hidden``)
        self.mask_hidden = nn.Parameter(torch.randn(taps * H))
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    # the network and its warm starts are EAGLE-3's
    fuse = Eagle3Head.fuse
    step = Eagle3Head.step
    init_from_target = Eagle3Head.init_from_target
    init_layer_from_target = Eagle3Head.init_layer_from_target
    init_lm_head_from_target = Eagle3Head.init_lm_head_from_target

    @classmethod
    def tokens_per_draft(cls, config: HeadConfig) -> int:
        return config.block_size  # the last element's own output and block_size - 1 mask slots

    def mask_elements(self, batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [batch, n], g [batch, n, H]) of n mask slots: the mask token and the fused ``mask_hidden``."""
        ids = torch.full((batch, n), self.config.mask_token_id, dtype=torch.long, device=self.device)
        g = self.fuse(self.mask_hidden)
        return ids, g.expand(batch, n, g.shape[-1])

    @torch.no_grad()
    def draft(self, cache: HeadCache, ids: torch.Tensor, g: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        self._check_draft(cache, ids, g, position_ids)
        B, P = ids.shape
        kept, slots = cache.length, self.draft_depths - 1
        pos = position_ids.to(self.device).expand(B, P)
        m_ids, m_g = self.mask_elements(B, slots)
        m_pos = pos[:, -1:] + torch.arange(1, slots + 1, device=self.device)
        # plain causal over [pending; slots]: a slot sees every pending element and the slots before it
        _, logits = self.step(torch.cat([ids.to(self.device), m_ids], 1),
                              torch.cat([g.to(self.device, self.dtype), m_g.to(self.dtype)], 1),
                              torch.cat([pos, m_pos], 1), cache=cache)
        cache.crop(kept + P)  # only the exact, target-fed elements stay
        return logits[:, P - 1:]

    # ---- training ----------------------------------------------------------------------------------
    def training_loss(self, teacher, batch: dict, loss, *, steps: int, train: bool = True):
        """P-EAGLE's objective: at every anchor t (element (g_t, x_{t+1})) and depth k+1 <= block_size,
        ``position_loss`` of the block's depth-(k+1) logits against the teacher at position t+1+k (the
        target's distribution over x_{t+2+k}), weighted ``loss.step_decay ** k``; a position counts when
        ``loss_mask`` is 1 at the predicted token and the teacher's argmax is in the draft vocabulary, as
        for EAGLE-3. Normalisation: the trainer divides the sum by the batch's depth-1 supervised count
        (``supervised_count``), as it does the TTT sum, so a depth's weight relative to depth 1 is its decay
        times its share of supervised positions, the same for every kind. StepStats has ``steps`` entries;
        depths past the block (``steps > block_size``) are scored as misses: a block cannot propose them.

        ``loss.cod_ratio`` > 0 trains with P-EAGLE's COD sampling instead: depth k+1 keeps a nested share
        max(cod_ratio**k, cod_floor) of the anchors (``cod_draws``; every anchor at depth 1), each kept position
        weighing 1 — the depths' relative weights are then their shares — and depths >= 2 run only the anchors
        some row keeps there (``cod_order``): the work COD saves. Training stats count the kept anchors.
        Evaluation (``train=False``) runs and scores every anchor."""
        ids, loss_mask, last = batch["input_ids"], batch["loss_mask"], batch["last"]
        chunk, decay = loss.chunk_tokens, loss.step_decay
        source, weight = teacher.source(last, chunk, loss.cache_teacher_mb)
        top = batch.get("top")
        if top is None:
            top = teacher.targets(last, chunk)
        total, stats = torch.zeros((), device=ids.device), StepStats()
        depths = min(steps, self.draft_depths)
        cod = getattr(loss, "cod_ratio", 0.0) if train else 0.0
        shares = [max(cod ** k, loss.cod_floor) for k in range(depths)] if cod > 0 else None
        draw = self.cod_draws(batch, train) if cod > 0 else None
        order, counts = self.cod_order(draw, loss_mask, shares) if cod > 0 else (None, None)
        all_right = None
        for k, logits in self.block_unroll(ids, self.training_features(batch), depths, order, counts):
            rows = None if order is None or k == 0 else order[:, :counts[k]]  # the anchors depth k+1 ran
            valid = at_rows(shift_left(loss_mask, 2 + k).bool(), rows)
            want = at_rows(shift_left(top, 1 + k, fill=-1), rows)
            if draw is not None:
                valid = valid & (at_rows(draw, rows) < shares[k])
            row_w = (valid & (want >= 0)).float() * (decay ** k if draw is None else 1.0)
            teacher_k = TeacherRows.shifted(source, 1 + k)  # by index: no per-depth copy kept for backward
            teacher_k = TeacherRows(teacher_k.source, at_rows(teacher_k.at, rows))
            term = position_loss(logits, teacher_k, weight, row_w, loss)
            total = total + term
            with torch.no_grad():
                right = logits.argmax(-1) == want
                # a chain: every earlier depth of the same anchor right (depth k's anchors: a prefix of k-1's)
                all_right = right if all_right is None else right & (
                    all_right if rows is None else all_right.gather(1, rows) if k == 1 else all_right[:, :rows.shape[1]])
                stats.loss.append(float(term))
                stats.correct.append(int((right & valid).sum()))
                stats.total.append(int(valid.sum()))
                stats.chain.append(int((all_right & valid).sum()))
        for k in range(len(stats.loss), steps):  # past the block: nothing proposed, every position a miss
            stats.loss.append(0.0)
            stats.correct.append(0)
            stats.total.append(int(shift_left(loss_mask, 2 + k).sum()))
            stats.chain.append(0)
        return total, stats

    def cod_draws(self, batch: dict, train: bool) -> torch.Tensor:
        """One uniform draw per anchor [B, S] (seeded per sequence, ``row_seed``): anchor t trains at depth k+1
        when its draw is below that depth's share, so the anchors kept at a depth are kept at every shallower one."""
        ids = batch["input_ids"]
        rows = [torch.rand(ids.shape[1], generator=torch.Generator().manual_seed(self.row_seed(batch, b, train)))
                for b in range(ids.shape[0])]
        return torch.stack(rows).to(ids.device)

    def cod_order(self, draw: torch.Tensor, loss_mask: torch.Tensor, shares: list[float]):
        """(order [B, S], counts): each row's anchors by ``draw``, ascending, those no depth >= 2 supervises
        last; depth k+1 >= 2 runs each row's first counts[k] (the most any row keeps at that share). The
        anchors kept at a depth are the prefix kept at the shallower ones, so one order serves every depth."""
        later = torch.zeros_like(loss_mask, dtype=torch.bool)
        for k in range(1, len(shares)):
            later |= shift_left(loss_mask, 2 + k).bool()
        key = draw.masked_fill(~later, 2.0)  # draws are < 1: never kept
        counts = [draw.shape[1]] + [max(1, int((key < share).sum(1).max())) for share in shares[1:]]
        return key.sort(dim=1, stable=True).indices, counts

    def block_unroll(self, input_ids: torch.Tensor, g: torch.Tensor, depths: int, order=None, counts=None):
        """Yield ``(k, logits)`` for depths k+1 = 1..``depths`` of every anchor of a (right-padded) batch:
        k = 0 is the causal pass over the real elements; k >= 1 are the anchors' mask elements at positions
        t+k, under ``ttt_mask(S, k)``'s pattern (real elements <= t, the anchor's own mask elements), which
        a TTTCache computes without the mask, in memory linear in S. With ``order``/``counts``
        (``cod_order``) depth k >= 1 runs only the anchors ``order[:, :counts[k]]``, its logits in that order."""
        B, S = input_ids.shape
        cache = TTTCache()
        pos0 = torch.arange(S, device=input_ids.device).expand(B, S)
        m_ids, m_g = self.mask_elements(B, S)
        for k in range(depths):
            tok, feat, pos = (shift_left(input_ids, 1), g, pos0) if k == 0 else (m_ids, m_g, pos0 + k)
            if k > 0 and order is not None:
                n = counts[k]
                cache.rows = order[:, :n].to(input_ids.device)
                tok, feat, pos = m_ids[:, :n], m_g[:, :n], cache.rows + k
            _, logits = self.step(tok, feat, pos, cache=cache)
            yield k, logits


def at_rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``x`` [B, S, ...] at the anchors ``rows`` [B, N] (every position for None)."""
    if rows is None:
        return x
    return x.gather(1, rows.view(*rows.shape, *[1] * (x.dim() - 2)).expand(*rows.shape, *x.shape[2:]))
