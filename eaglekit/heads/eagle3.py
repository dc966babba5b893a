"""EAGLE-3 head (Li et al. 2025): fused low/mid/high taps, one wide decoder layer, its own draft lm_head.

What makes it EAGLE-3, all here: it reads the concatenated inputs of its tap layers (the target's
default taps unless given), fuses them with ``fc``, predicts over a draft vocabulary (``d2t``/``t2d``)
and trains on the soft cross-entropy alone; it can start its lm_head and norm from the target's.

EAGLE 3.1's two options (both off by default; a head without them runs exactly the EAGLE-3 path):
``fc_norm`` puts an RMSNorm on each tap before ``fc`` (``fc_norm.{i}``, as vLLM / SGLang / speculators
name them), and ``norm_output`` makes ``step`` return the post-norm hidden state — the feature the next
draft step reads, in training's unroll and in decoding's tree alike — instead of the pre-norm one.
"""
from __future__ import annotations

import torch
from torch import nn

from eaglekit.heads.base import DraftHead
from eaglekit.heads.config import EAGLE3, HeadConfig
from eaglekit.heads.layers import MLP, Attention, DecoderLayer, HeadCache, RMSNorm


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
    # how the model card names it and the engines serve it (heads.hub)
    display_name, vllm_method, sglang_algorithm = "EAGLE-3", "eagle3", "EAGLE3"
    speculators_model = ("speculators.models.eagle3", "Eagle3DraftModel")

    def __init__(self, config: HeadConfig):
        if config.kind != EAGLE3:
            raise ValueError(f"Eagle3Head needs kind='eagle3', got {config.kind!r}")
        config.validate()
        super().__init__(config)
        H, taps = config.hidden_size, len(config.aux_layer_ids)
        if config.fc_norm:  # registered only when set: an EAGLE-3 head's state dict stays as it was
            self.fc_norm = nn.ModuleList([RMSNorm(H, config.rms_norm_eps) for _ in range(taps)])
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
        return self.fc(taps)

    def step(self, input_ids, g, position_ids, cache: HeadCache | None = None, attn_mask=None):
        """One head pass over S (feature, next token) pairs → (hidden [B,S,H], logits [B,S,Vd]); hidden is
        the feature the next draft step reads: before the final norm, or after it under norm_output."""
        self._check_step(input_ids, g, position_ids, cache, attn_mask)
        dtype = self.dtype
        cos, sin = self.rotary(position_ids.to(self.device), dtype)
        mask = None if attn_mask is None else attn_mask.to(self.device, dtype)
        x = self.layers[0](self.embed(input_ids), g.to(dtype), cos, sin, cache, mask)
        for layer in self.layers[1:]:
            x = layer(x, cos, sin, cache, mask)
        normed = self.norm(x)
        return (normed if self.config.norm_output else x), self.lm_head(normed)

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
