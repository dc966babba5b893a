"""Small Llama-style layers for the heads: RMSNorm, RoPE, attention over a HeadCache (decoding) or a
TTTCache (training's unroll, ``heads.ttt_attention``), SwiGLU MLP.

Weight names and layouts follow the Llama convention (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,
down}_proj``, ``input_layernorm``, ``post_attention_layernorm``, rotate-half RoPE) so exports load in
vLLM and SGLang unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from eaglekit.heads.cache import HeadCache, causal_mask
from eaglekit.heads.config import HeadConfig
from eaglekit.heads.ttt_attention import TTTCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos/sin for explicit position ids; plain RoPE, or any scaling transformers knows (llama3, yarn...)."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        if cfg.rope_scaling:
            kind = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
            inv_freq, self.scale = ROPE_INIT_FUNCTIONS[kind](cfg.llama_config(), None)
        else:
            d = cfg.head_dim
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
            self.scale = 1.0
        # a plain attribute, not a buffer: head.to(bfloat16) must not round the frequencies
        self.inv_freq = inv_freq.float()

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, S, head_dim]
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, d]; cos/sin [B, S, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class Attention(nn.Module):
    """Grouped-query attention whose q/k/v read ``in_features`` (2H in EAGLE-3's first layer)."""

    def __init__(self, cfg: HeadConfig, in_features: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_features, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, layer: int, cache: HeadCache | None, mask: torch.Tensor | None):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(cache, TTTCache):  # training's unroll: its step structure, no mask (linear memory)
            if mask is not None:
                raise ValueError("Attention: a TTTCache takes no attn_mask (its steps' pattern is fixed)")
            return self.o_proj(cache.attend(layer, q, k, v).transpose(1, 2).reshape(B, S, -1))
        if cache is not None:
            k, v = cache.update(layer, k, v)
        if mask is None:
            mask = causal_mask(S, k.shape[2] - S, q.dtype, q.device)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm Llama layer; ``input_norm=False`` drops the input norm (EAGLE-1's first layer)."""

    def __init__(self, cfg: HeadConfig, layer: int, input_norm: bool = True):
        super().__init__()
        self.layer = layer
        if input_norm:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache=None, mask=None):
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        x = x + self.self_attn(h, cos, sin, self.layer, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))
