"""The head's own KV cache, the attention masks its step takes, and the shift that aligns a sequence
with training-time-test step k.

Masks are additive floats ``[B or 1, 1, S, T_cache_before + S]``: 0 = attend, ``finfo.min`` = blocked
(finfo.min rather than -inf so a row that a caller blocks entirely gives zeros, not NaN).
"""
from __future__ import annotations

import torch


class HeadCache:
    """Per-layer keys/values after RoPE, each ``[B, kv_heads, T, head_dim]``."""

    def __init__(self, num_layers: int | None = None):
        self.keys: list[torch.Tensor | None] = [None] * (num_layers or 0)
        self.values: list[torch.Tensor | None] = [None] * (num_layers or 0)

    @property
    def length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[2]

    def __len__(self) -> int:
        return self.length

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new k/v for ``layer``; return everything cached for it (old + new)."""
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def _map(self, fn) -> None:
        self.keys = [None if k is None else fn(k) for k in self.keys]
        self.values = [None if v is None else fn(v) for v in self.values]

    def crop(self, n_keep: int) -> HeadCache:
        """Keep the first ``n_keep`` positions (rollback is truncation)."""
        if n_keep < 0:
            raise ValueError(f"HeadCache.crop: n_keep must be >= 0, got {n_keep}")
        self._map(lambda t: t[:, :, :n_keep])
        return self

    def keep(self, indices) -> HeadCache:
        """Keep the given positions along T, in the given order.

        ``indices``: 1-D (same for every row) or ``[B, n]`` (one list per batch row).
        """
        idx = torch.as_tensor(indices, dtype=torch.long)
        if idx.dim() == 1:
            self._map(lambda t: t.index_select(2, idx.to(t.device)))
        else:
            def gather(t):
                i = idx.to(t.device)[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
                return t.gather(2, i)
            self._map(gather)
        return self

    def clone(self) -> HeadCache:
        out = HeadCache()
        out.keys = [None if k is None else k.clone() for k in self.keys]
        out.values = [None if v is None else v.clone() for v in self.values]
        return out


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
