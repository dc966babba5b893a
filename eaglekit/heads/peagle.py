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
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from eaglekit.heads.config import PEAGLE, HeadConfig
from eaglekit.heads.eagle3 import Eagle3FirstLayer, Eagle3Head
from eaglekit.heads.layers import DecoderLayer, HeadCache, RMSNorm, shift_left
from eaglekit.heads.objectives import StepStats, position_loss, teacher_probs
from eaglekit.heads.parallel import ParallelHead
from eaglekit.heads.ttt_attention import TTTCache


class PEagleHead(ParallelHead):
    kind = PEAGLE
    reads = "taps"
    has_draft_vocab = True
    # the model card's name; vLLM reads the method from the speculators config and drafts the block in one
    # forward with parallel_drafting; SGLang has no P-EAGLE loader (docs/exports.md)
    display_name, vllm_method, sglang_algorithm = "P-EAGLE", None, None
    vllm_options: ClassVar[dict] = {"parallel_drafting": True}
    speculators_model = ("speculators.models.peagle", "PEagleDraftModel")

    def __init__(self, config: HeadConfig):
        if config.kind != PEAGLE:
            raise ValueError(f"PEagleHead needs kind='peagle', got {config.kind!r}")
        config.validate()
        if config.fc_norm or config.norm_output:  # vLLM's and speculators' P-EAGLE configs carry neither
            raise ValueError("PEagleHead: fc_norm / norm_output (EAGLE 3.1) are not P-EAGLE options; leave them off")
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
        depths past the block (``steps > block_size``) are scored as misses: a block cannot propose them."""
        ids, loss_mask, last = batch["input_ids"], batch["loss_mask"], batch["last"]
        chunk, decay = loss.chunk_tokens, loss.step_decay
        cached = ids.numel() * teacher.draft_weight.shape[0] * 4 <= loss.cache_teacher_mb * 2**20
        source, weight = (teacher_probs(last, teacher.draft_weight, chunk), None) if cached \
            else (last, teacher.draft_weight)
        top = batch.get("top")
        if top is None:
            top = teacher.targets(last, chunk)
        total, stats = torch.zeros((), device=ids.device), StepStats()
        all_right = torch.ones_like(ids, dtype=torch.bool)
        for k, logits in self.block_unroll(ids, self.training_features(batch), min(steps, self.draft_depths)):
            valid = shift_left(loss_mask, 2 + k).bool()
            want = shift_left(top, 1 + k, fill=-1)
            row_w = (valid & (want >= 0)).float() * (decay ** k)
            term = position_loss(logits, shift_left(source, 1 + k), weight, row_w, loss)
            total = total + term
            with torch.no_grad():
                right = logits.argmax(-1) == want
                all_right &= right
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

    def block_unroll(self, input_ids: torch.Tensor, g: torch.Tensor, depths: int):
        """Yield ``(k, logits)`` for depths k+1 = 1..``depths`` of every anchor of a (right-padded) batch:
        k = 0 is the causal pass over the real elements; k >= 1 are the anchors' mask elements at positions
        t+k, under ``ttt_mask(S, k)``'s pattern (real elements <= t, the anchor's own mask elements), which
        a TTTCache computes without the mask, in memory linear in S."""
        B, S = input_ids.shape
        cache = TTTCache()
        pos0 = torch.arange(S, device=input_ids.device).expand(B, S)
        m_ids, m_g = self.mask_elements(B, S)
        for k in range(depths):
            tok, feat = (shift_left(input_ids, 1), g) if k == 0 else (m_ids, m_g)
            _, logits = self.step(tok, feat, pos0 + k, cache=cache)
            yield k, logits
