"""EAGLE-1 head (Li et al. 2024): predicts the target's next last-layer feature; the target's lm_head reads it.

What makes it EAGLE-1, all here: it reads the target's ``last`` feature (no taps), predicts over the
whole target vocabulary, and trains with feature noise plus a SmoothL1 regression onto the next feature
beside the (down-weighted) token loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eaglekit.heads.base import LastHead
from eaglekit.heads.config import EAGLE1, HeadConfig
from eaglekit.heads.layers import DecoderLayer, HeadCache, shift_left


class Eagle1Head(LastHead):
    kind = EAGLE1
    # how the model card names it and the engines serve it (eaglekit.export.hub)
    display_name, vllm_method, sglang_algorithm, speculators_model = "EAGLE-1", "eagle", "EAGLE", None

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        H = config.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=True)
        # the first layer has no input norm: fc's output goes straight into attention (as in EAGLE-1)
        self.layers = nn.ModuleList([DecoderLayer(config, i, input_norm=i > 0) for i in range(config.num_layers)])

    def training_features(self, batch: dict, noise: float = 0.0) -> torch.Tensor:
        """``last`` plus EAGLE-1's uniform feature noise U(-noise, noise) (scaled like EAGLE's)."""
        last = batch["last"]
        if noise > 0:
            last = last + (torch.rand_like(last, dtype=torch.float32) * 2 - 1).to(last.dtype) * noise
        return self.fuse(last)

    def step_loss(self, ce, hidden, batch, step, valid, loss) -> torch.Tensor:
        """``token_weight`` x CE plus ``feature_weight`` x SmoothL1 onto the next feature f_{t+1+step}."""
        next_feature = shift_left(batch["last"], 1 + step)
        l1 = F.smooth_l1_loss(hidden.float(), next_feature.float(), reduction="none").mean(-1)
        return ce * loss.token_weight + loss.feature_weight * (loss.step_decay ** step) * (l1 * valid.float()).sum()

    def step(self, input_ids, g, position_ids, cache: HeadCache | None = None, attn_mask=None):
        """→ (predicted next feature f̂ [B,S,H], logits over the target vocab [B,S,V] via target.lm_head)."""
        self._check_step(input_ids, g, position_ids, cache, attn_mask)
        dtype = self.dtype
        cos, sin = self.rotary(position_ids.to(self.device), dtype)
        mask = None if attn_mask is None else attn_mask.to(self.device, dtype)
        x = self.fc(torch.cat([self.embed(input_ids), g.to(dtype)], dim=-1))
        for layer in self.layers:
            x = layer(x, cos, sin, cache, mask)
        lm_head = self.target_module("lm_head")
        return x, lm_head(x.to(lm_head.weight.device, lm_head.weight.dtype))
