"""Small Llama-style layers for the heads and the head's own KV cache: RMSNorm, RoPE, attention over a
HeadCache (decoding) or a TTTCache (training's unroll, ``heads.ttt_attention``), SwiGLU MLP; the masks a head
step takes, and the shift that aligns a sequence with training-time-test step k.

Weight names and layouts follow the Llama convention (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,
down}_proj``, ``input_layernorm``, ``post_attention_layernorm``, rotate-half RoPE) so exports load in
vLLM and SGLang unchanged. Masks are additive floats ``[B or 1, 1, S, T_cache_before + S]``: 0 = attend,
``finfo.min`` = blocked (finfo.min rather than -inf so a row that a caller blocks entirely gives zeros, not
NaN).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from eaglekit.heads.config import HeadConfig

# ---- the head's KV cache: preallocated buffers, one length per row ------------------------------------
MIN_CAPACITY = 64  # positions a layer's first buffer holds at least


def _grown(old, like: torch.Tensor, rows: int, need: int, v_like: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """New zeroed key and value buffers [rows, kv_heads, capacity, head_dim] (like ``like``, the values like
    ``v_like`` where they differ in width: an MTP head's MLA block caches a latent and a rotary part) with room for
    ``need`` positions, holding ``old``'s contents (converted if the head was moved or cast). A full buffer
    is replaced by one at least twice as long, so over a whole decode the copies cost O(1) per position
    appended (amortised) and happen a handful of times. Zeros, not empty memory: positions past a row's
    length are read under a mask, and a masked NaN would still poison the softmax."""
    have = 0 if old is None else old[0].shape[2]
    if old is None:
        capacity = max(2 * need, MIN_CAPACITY)
    else:
        capacity = have if have >= need else max(need, 2 * have)
        rows = max(rows, old[0].shape[0])
    v_like = like if v_like is None else v_like
    k = like.new_zeros(rows, like.shape[1], capacity, like.shape[3])
    v = like.new_zeros(rows, v_like.shape[1], capacity, v_like.shape[3])
    if old is not None:
        k[:old[0].shape[0], :, :have] = old[0]
        v[:old[1].shape[0], :, :have] = old[1]
    return k, v


class HeadCache:
    """Per-layer keys/values after RoPE, in one preallocated buffer per layer ``[B, kv_heads, capacity,
    head_dim]`` written in place; the first ``length`` positions are the cache. Rollback (``crop``) moves
    the length, ``keep`` gathers in place, a full buffer is replaced by one at least twice as long."""

    def __init__(self, num_layers: int | None = None):
        self._buffers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * (num_layers or 0)
        self._lengths: list[int] = [0] * (num_layers or 0)  # per layer: a step updates them one by one

    @property
    def length(self) -> int:
        return self._lengths[0] if self._lengths else 0

    def __len__(self) -> int:
        return self.length

    def _current(self, layer: int):
        """Layer ``layer``'s (key, value) buffers, None before its first update."""
        return self._buffers[layer] if layer < len(self._buffers) else None

    def _storage(self, layer: int, like: torch.Tensor, need: int, v_like: torch.Tensor | None = None):
        """Layer ``layer``'s buffers with room for ``need`` positions (``like``: the keys going in)."""
        while len(self._lengths) <= layer:
            self._buffers.append(None)
            self._lengths.append(0)
        buf = self._buffers[layer]
        if buf is not None and buf[0].shape[0] != like.shape[0]:
            raise ValueError(f"HeadCache.update: layer {layer} holds {buf[0].shape[0]} rows, got {like.shape[0]}")
        if buf is None or buf[0].shape[2] < need or buf[0].dtype != like.dtype or buf[0].device != like.device:
            buf = self._buffers[layer] = _grown(buf, like, like.shape[0], need, v_like)
        return buf

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new k/v for ``layer`` after its cached ones; return everything cached for it (views)."""
        start = self._lengths[layer] if layer < len(self._lengths) else 0
        end = start + k.shape[2]
        kb, vb = self._storage(layer, k, end, v)
        kb[:, :, start:end] = k
        vb[:, :, start:end] = v
        self._lengths[layer] = end
        return kb[:, :, :end], vb[:, :, :end]

    def attend(self, layer: int, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        """``Attention``'s call on any cache (a ``TTTCache`` has its own): write k/v, attend over all held."""
        k, v = self.update(layer, k, v)
        return attention(q, k, v, mask)

    @property
    def keys(self) -> list[torch.Tensor | None]:
        """Per layer the cached keys ``[B, kv_heads, length, head_dim]`` (views of the buffers)."""
        return [None if (b := self._current(i)) is None else b[0][:, :, :n] for i, n in enumerate(self._lengths)]

    @property
    def values(self) -> list[torch.Tensor | None]:
        return [None if (b := self._current(i)) is None else b[1][:, :, :n] for i, n in enumerate(self._lengths)]

    def crop(self, n_keep: int) -> HeadCache:
        """Keep the first ``n_keep`` positions (rollback moves the length)."""
        if n_keep < 0:
            raise ValueError(f"HeadCache.crop: n_keep must be >= 0, got {n_keep}")
        self._lengths[:] = [min(n, n_keep) for n in self._lengths]
        return self

    def keep(self, indices) -> HeadCache:
        """Keep the given positions along T, in the given order (gathered into the buffer's front).

        ``indices``: 1-D (same for every row) or ``[B, n]`` (one list per batch row).
        """
        idx = torch.as_tensor(indices, dtype=torch.long)
        for layer in range(len(self._lengths)):
            for buf in self._current(layer) or ():
                i = idx.to(buf.device)
                if i.dim() == 1:
                    kept = buf.index_select(2, i)
                else:
                    kept = buf.gather(2, i[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[3]))
                buf[:, :, :i.shape[-1]] = kept
            self._lengths[layer] = idx.shape[-1]
        return self

    def clone(self) -> HeadCache:
        out = HeadCache()
        out._buffers = [None if (b := self._current(i)) is None else (b[0].clone(), b[1].clone())
                        for i in range(len(self._lengths))]
        out._lengths = list(self._lengths)
        return out


class HeadRows:
    """The decode rows of one head in one preallocated buffer per layer ``[rows, kv_heads, capacity,
    head_dim]``: ``row()`` is one sequence's ``HeadCache`` (a batch row of the buffer with its own length),
    and ``RowsStep`` lets one head forward write every row's new entries in place at that row's length, so
    catching several rows up concatenates nothing. A row's slot is freed when its cache is dropped, and the
    buffers with the last one: a row that leaves the batch keeps nothing alive."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.buffers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.lengths: list[list[int] | None] = []  # per slot its per-layer lengths; None: a free slot

    def row(self) -> RowCache:
        slot = next((s for s, n in enumerate(self.lengths) if n is None), len(self.lengths))
        if slot == len(self.lengths):
            self.lengths.append(None)
        self.lengths[slot] = [0] * self.num_layers
        cache = RowCache(self, slot)
        weakref.finalize(cache, self._release, slot)
        return cache

    def _release(self, slot: int) -> None:
        self.lengths[slot] = None
        if all(n is None for n in self.lengths):
            self.buffers, self.lengths = [None] * self.num_layers, []

    def reserve(self, layer: int, like: torch.Tensor, need: int, v_like: torch.Tensor | None = None):
        """Layer ``layer``'s buffers with a batch row per slot and room for ``need`` positions."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"HeadRows: layer {layer} out of range for a head of {self.num_layers} layers")
        buf = self.buffers[layer]
        if (buf is None or buf[0].shape[2] < need or buf[0].shape[0] < len(self.lengths)
                or buf[0].dtype != like.dtype or buf[0].device != like.device):
            buf = self.buffers[layer] = _grown(buf, like, len(self.lengths), need, v_like)
        return buf


class RowCache(HeadCache):
    """Slot ``slot`` of a ``HeadRows``: a ``HeadCache`` over that batch row of the shared buffers."""

    def __init__(self, rows: HeadRows, slot: int):
        self.rows, self.slot = rows, slot
        self._lengths = rows.lengths[slot]  # the same list: a RowsStep moves it

    def _current(self, layer: int):
        buf = self.rows.buffers[layer] if layer < self.rows.num_layers else None
        return None if buf is None else (buf[0][self.slot:self.slot + 1], buf[1][self.slot:self.slot + 1])

    def _storage(self, layer: int, like: torch.Tensor, need: int, v_like: torch.Tensor | None = None):
        if like.shape[0] != 1:
            raise ValueError(f"RowCache.update: one row's cache takes [1, ...] keys, got {list(like.shape)}")
        self.rows.reserve(layer, like, need, v_like)
        return self._current(layer)


class RowsStep:
    """Slots ``lo..hi-1`` of a ``HeadRows`` in one head forward of S new elements per row: ``update`` writes
    row b's at its own length ``offsets[b]`` and returns every row's keys up to the longest; ``mask`` lets
    row b's element i see the row's first ``offsets[b] + i + 1`` positions only (its cache and its own new
    elements, causally), so each row computes what it would alone. A slot in the range that takes no part
    writes past its own length, where nothing is kept. ``advance`` then moves a row's length."""

    def __init__(self, rows: HeadRows, lo: int, hi: int, device):
        self.rows, self.lo, self.hi = rows, lo, hi
        self.offsets = [rows.lengths[s][0] if rows.lengths[s] is not None else 0 for s in range(lo, hi)]
        self.length = max(self.offsets)  # the keys before the new ones (what the mask's width counts)
        self._offsets = torch.tensor(self.offsets, device=device)
        self._at = None

    def positions(self, new: int) -> torch.Tensor:
        return self._offsets[:, None] + torch.arange(new, device=self._offsets.device)

    def mask(self, new: int, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, 1, new, length + new]`` additive."""
        cols = torch.arange(self.length + new, device=self._offsets.device)
        allowed = cols[None, None, :] <= self.positions(new)[:, :, None]
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, blocked(dtype))[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new, width = k.shape[2], self.length + k.shape[2]
        kb, vb = self.rows.reserve(layer, k, width, v)
        if self._at is None or self._at.shape[2] != new:  # the same for every layer of one forward
            self._at = self.positions(new).to(k.device)[:, None, :, None]
        kb[self.lo:self.hi].scatter_(2, self._at.expand(k.shape), k)
        vb[self.lo:self.hi].scatter_(2, self._at.expand(v.shape), v)
        return kb[self.lo:self.hi, :, :width], vb[self.lo:self.hi, :, :width]

    attend = HeadCache.attend  # write the rows' k/v, attend over what update returns

    def advance(self, slot: int, n: int) -> None:
        """Slot ``slot``'s row now holds its first ``n`` new elements too."""
        self.rows.lengths[slot][:] = [self.offsets[slot - self.lo] + n] * self.rows.num_layers


def blocked(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min


def causal_mask(new: int, past: int = 0, dtype=torch.float32, device=None) -> torch.Tensor:
    """``[1, 1, new, past + new]``: full over the ``past`` cached keys, causal over the new ones."""
    m = torch.zeros(new, past + new, dtype=dtype, device=device)
    upper = torch.ones(new, new, dtype=torch.bool, device=device).triu(1)
    m[:, past:].masked_fill_(upper, blocked(dtype))
    return m[None, None]


def ttt_mask(seq_len: int, step: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Mask for training-time-test step ``step`` (0-based) over a cache holding steps ``0..step-1``.

    Element t of step k attends step-0 keys at indices <= t and the step-j keys (1 <= j <= k) at
    exactly index t, i.e. its own drafted chain — what tree drafting from prefix t would see.
    Shape ``[1, 1, S, (step + 1) * S]``; ``step=0`` is the plain causal mask.
    """
    m = causal_mask(seq_len, 0, dtype, device)[0, 0]
    own = torch.full((seq_len, seq_len), blocked(dtype), dtype=dtype, device=device)
    own.fill_diagonal_(0.0)
    return torch.cat([m] + [own] * step, dim=1)[None, None]


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """``out[:, t] = x[:, t + n]`` along dim 1, padded with ``fill`` past the end (TTT step k reads
    token, position and teacher ``1 + k`` ahead of element t)."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


# ---- the layers -------------------------------------------------------------------------------------
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
        out = attention(q, k, v, mask) if cache is None else cache.attend(layer, q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA of ``q`` [B, heads, S, d] over ``k``/``v`` [B, kv_heads, T, d] (the last S of them new): under
    ``mask``, else causal over the new keys; grouped-query heads repeated."""
    S = q.shape[2]
    if mask is None:
        mask = causal_mask(S, k.shape[2] - S, q.dtype, q.device)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))


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
