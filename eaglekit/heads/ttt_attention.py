"""Training-time-test attention in memory linear in the sequence length.

At TTT step k, element t attends the step-0 keys at indices <= t (causal) and the step-j keys
(1 <= j <= k) at exactly index t (a diagonal: its own drafted chain). ``heads.layers.ttt_mask`` spells
this as an additive ``[S, (k+1)·S]`` mask, which costs memory quadratic in S (and is kept for the
backward pass). Here the same softmax is computed without any mask:

- step 0 is plain causal attention (``scaled_dot_product_attention(is_causal=True)``);
- step k >= 1 on the CPU (``_CausalPlusDiagonal``): PyTorch's fused causal flash kernel gives the step-0
  output and each row's log-sum-exp; the k diagonal scores (elementwise, ``[S, k]``) join that softmax by
  log-sum-exp arithmetic, and the backward pass hands the kernel's own backward the rescaled gradient and
  the joint output, which makes its causal gradients those of the joint softmax. Nothing quadratic is
  kept or built, and no Python loop runs over the rows (timings against the other paths: RESULTS.md);
- step k >= 1 elsewhere, or where that kernel is missing (``_TTTAttention``): the queries ``chunk`` rows
  at a time; the rows' scores against the step-0 keys up to the chunk's end (causal inside the chunk's
  own columns) and their k diagonal scores share one softmax. Only the output and each row's log-sum-exp
  are kept; the backward pass recomputes the chunk's probabilities from them (the flash-attention
  recipe), so the memory beyond the inputs is ``chunk x S`` per head at any time, never ``S x S``.

Both equal the masked softmax in value and gradient (tests/train/test_train_ttt_linear.py, each path).

A step may also cover only some of the positions (``TTTCache.rows``: P-EAGLE's COD keeps a shrinking share
of the anchors per depth, and only those are run): its queries are the anchors ``rows`` [B, N] in an order
whose prefixes are the later steps' anchors, so a query's own earlier-step keys are the earlier steps' first
N; the step-0 keys it sees are those at indices <= its anchor (a [B, 1, N, S] mask instead of the causal
flag; the same two paths take it).

Decoding does not use this: its tree masks go through ``HeadCache`` and ``Attention``'s mask path.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 2 ** 23  # scores held at once (B x heads x rows x keys fp32, 32 MiB); sets the row chunk


def _rows_per_chunk(batch: int, heads: int, keys: int) -> int:
    """Query rows per chunk so that one chunk's scores stay near ``CHUNK_ELEMENTS``."""
    return max(16, CHUNK_ELEMENTS // max(1, batch * heads * keys))


def _chunk_scores(q, k0, kd, a: int, b: int, scale: float, anchors=None) -> torch.Tensor:
    """fp32 scores of query rows a..b-1: [.., rows, end + steps], step-0 keys 0..end-1 then diagonals, the
    keys past each row's own index (``anchors`` [B, N]: the rows' indices; else the row itself) masked out;
    end = b, or every key for ``anchors``."""
    qb, end = q[:, :, a:b], _keys_end(k0, b, anchors)
    s0 = (qb @ k0[:, :, :end].transpose(-1, -2)) * scale
    rows = torch.arange(a, b, device=q.device)[:, None] if anchors is None else anchors[:, None, a:b, None]
    s0 = s0.masked_fill(torch.arange(end, device=q.device) > rows, float("-inf"))
    sd = (qb[:, :, None] * kd[:, :, :, a:b]).sum(-1).movedim(2, -1) * scale  # [B, h, rows, steps]
    return torch.cat([s0, sd], dim=-1)


def _keys_end(k0: torch.Tensor, b: int, anchors) -> int:
    """Step-0 keys a chunk of rows ending at b can see: up to b (row = index), every one for anchors."""
    return b if anchors is None else k0.shape[2]


class _TTTAttention(torch.autograd.Function):
    """softmax over (causal step-0 keys, diagonal step-j keys); inputs fp32, already GQA-expanded.

    q [B, h, N, d]; k0, v0 [B, h, S, d]; kd, vd [B, h, steps, N, d]: the step-1..k keys/values; ``anchors``
    [B, N] the queries' indices (None: N = S, query i at index i)."""

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, anchors=None):
        N, scale, steps = q.shape[2], 1.0 / math.sqrt(q.shape[-1]), kd.shape[2]
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:3])
        chunk = _rows_per_chunk(q.shape[0], q.shape[1], k0.shape[2])
        for a in range(0, N, chunk):
            b = min(N, a + chunk)
            end = _keys_end(k0, b, anchors)
            s = _chunk_scores(q, k0, kd, a, b, scale, anchors)
            lse[:, :, a:b] = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - lse[:, :, a:b, None])
            p0, pd = p.split([end, steps], dim=-1)
            out[:, :, a:b] = p0 @ v0[:, :, :end] + (pd.movedim(-1, 2)[..., None] * vd[:, :, :, a:b]).sum(2)
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse, anchors)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k0, v0, kd, vd, out, lse, anchors = ctx.saved_tensors
        N, scale, steps = q.shape[2], 1.0 / math.sqrt(q.shape[-1]), kd.shape[2]
        dq, dk0, dv0 = torch.zeros_like(q), torch.zeros_like(k0), torch.zeros_like(v0)
        dkd, dvd = torch.zeros_like(kd), torch.zeros_like(vd)
        d_out = d_out.contiguous()
        for a in range(0, N, ctx.chunk):
            b = min(N, a + ctx.chunk)
            end = _keys_end(k0, b, anchors)
            p = torch.exp(_chunk_scores(q, k0, kd, a, b, scale, anchors) - lse[:, :, a:b, None])
            p0, pd = p.split([end, steps], dim=-1)
            pd = pd.movedim(-1, 2)  # [B, h, steps, rows]
            g, qb = d_out[:, :, a:b], q[:, :, a:b]
            row = (g * out[:, :, a:b]).sum(-1)  # sum_j p_j dP_j: the softmax's backward subtracts it
            # step-0 part
            dv0[:, :, :end] += p0.transpose(-1, -2) @ g
            ds0 = p0 * (g @ v0[:, :, :end].transpose(-1, -2) - row[..., None]) * scale
            dq[:, :, a:b] += ds0 @ k0[:, :, :end]
            dk0[:, :, :end] += ds0.transpose(-1, -2) @ qb
            # diagonal part: each row's own step-j key/value
            dvd[:, :, :, a:b] = pd[..., None] * g[:, :, None]
            dsd = pd * ((g[:, :, None] * vd[:, :, :, a:b]).sum(-1) - row[:, :, None]) * scale
            dq[:, :, a:b] += (dsd[..., None] * kd[:, :, :, a:b]).sum(2)
            dkd[:, :, :, a:b] = dsd[..., None] * qb[:, :, None]
        return dq, dk0, dv0, dkd, dvd, None


# The CPU's fused causal attention that also returns each row's log-sum-exp, and its backward (ATen ops
# behind scaled_dot_product_attention; None on a build without them, then the chunked path runs).
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
USE_CPU_FLASH = True  # False forces the chunked path (tests compare both against the mask path)


class _CausalPlusDiagonal(torch.autograd.Function):
    """``_TTTAttention``'s softmax from the CPU flash kernel: same inputs, same result.

    With o0, lse0 the causal step-0 attention and its log-sum-exp and s_j the diagonal scores, the joint
    softmax has lse = logaddexp(lse0, logsumexp_j s_j); the causal keys carry weight a = exp(lse0 - lse)
    in total, so out = a·o0 + sum_j exp(s_j - lse)·v_j. Backward: the kernel's causal backward computes
    p·(dO·v - dO·O) from the (dO, O) it is given; given a·dO and the joint output, that is the joint
    softmax's gradient at the causal keys (its probabilities are a·p). With ``anchors`` the kernel takes the
    rows' [B, 1, N, S] mask instead of its causal flag."""

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, anchors=None):
        scale = 1.0 / math.sqrt(q.shape[-1])
        mask = None if anchors is None else torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(
            torch.arange(k0.shape[2], device=q.device) > anchors[:, None, :, None], float("-inf"))  # additive, q's dtype
        o0, lse0 = _CPU_FLASH(q, k0, v0, 0.0, mask is None, attn_mask=mask, scale=scale)
        sd = (q[:, :, None] * kd).sum(-1) * scale  # [B, h, steps, S]
        lse = torch.logaddexp(lse0, torch.logsumexp(sd, dim=2))
        a, pd = torch.exp(lse0 - lse), torch.exp(sd - lse[:, :, None])
        out = o0 * a[..., None] + (pd[..., None] * vd).sum(2)
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse0, a, pd, mask)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k0, v0, kd, vd, out, lse0, a, pd, mask = ctx.saved_tensors
        g = d_out.contiguous()
        dq, dk0, dv0 = _CPU_FLASH_BACKWARD(g * a[..., None], q, k0, v0, out, lse0, 0.0, mask is None,
                                           attn_mask=mask, scale=ctx.scale)
        row = (g * out).sum(-1)  # sum_j p_j dP_j over the joint softmax
        dsd = pd * ((g[:, :, None] * vd).sum(-1) - row[:, :, None]) * ctx.scale
        dq = dq + (dsd[..., None] * kd).sum(2)
        return dq, dk0, dv0, dsd[..., None] * q[:, :, None], pd[..., None] * g[:, :, None], None


def uses_cpu_flash(q: torch.Tensor) -> bool:
    """Whether step k >= 1 runs through the CPU flash kernel (else the chunked softmax)."""
    return USE_CPU_FLASH and q.device.type == "cpu" and _CPU_FLASH is not None and _CPU_FLASH_BACKWARD is not None


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Step-k TTT attention of ``q`` [B, h, S, d] over ``keys``/``values`` of steps 0..k, each
    [B, kv_heads, S, d] (after RoPE): causal over step 0, the diagonal over steps 1..k. Equal to
    ``scaled_dot_product_attention`` under ``ttt_mask(S, k)`` within fp32 rounding (fp64 inputs: fp64
    rounding); returns q's dtype. An unroll calls it through ``TTTCache``, which expands each step once."""
    return _attend(q, [_expand(q, k) for k in keys], [_expand(q, v) for v in values])


def _expand(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Grouped-query keys or values → one head per query head, in the softmax's dtype (fp32; fp64 kept:
    exactness checks)."""
    return t.repeat_interleave(q.shape[1] // t.shape[1], dim=1).to(torch.promote_types(q.dtype, torch.float32))


def _attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], anchors=None) -> torch.Tensor:
    """``ttt_attention`` over keys/values already ``_expand``-ed; ``anchors`` [B, N]: the queries' indices
    when the step covers only those (``TTTCache.rows``), the later steps' keys cut to their first N."""
    if len(keys) == 1:  # step 0: plain causal attention, the fused kernel keeps no mask either
        k, v = keys[0].to(q.dtype), values[0].to(q.dtype)  # back to q's dtype: exact (it was widened)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    N = q.shape[2]
    kd, vd = torch.stack([k[:, :, :N] for k in keys[1:]], dim=2), torch.stack([v[:, :, :N] for v in values[1:]], dim=2)
    attend = _CausalPlusDiagonal if uses_cpu_flash(q) else _TTTAttention
    return attend.apply(q.to(kd.dtype), keys[0], values[0], kd, vd, anchors).to(q.dtype)


class TTTCache:
    """What one TTT unroll keeps per layer: each step's keys and values, in step order, GQA-expanded in the
    softmax's dtype when they arrive (step k's attention reads every earlier step: expanding them again at
    each step would copy them K²/2 times).

    ``Attention`` hands a layer's new keys to ``attend``, which stores them as the next step and returns
    the attention of that step (``ttt_attention``). Used only by training's unrolls (EAGLE's TTT,
    P-EAGLE's block depths); it takes no mask and holds no decoding state.

    ``rows`` (set by the unroll before a step; None = every position): the anchors [B, N] the steps after
    step 0 cover, each step's a prefix of the step before's (module docstring).
    """

    def __init__(self):
        self.shapes: dict[int, torch.Size] = {}  # per layer, step 0's keys as given: every step's
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}
        self.rows: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Keys held per layer, over every step so far (what ``HeadCache.length`` counts)."""
        return sum(k.shape[2] for k in self.keys.get(min(self.keys, default=0), []))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None:
            raise ValueError("Attention: a TTTCache takes no attn_mask (its steps' pattern is fixed)")
        keys, values = self.keys.setdefault(layer, []), self.values.setdefault(layer, [])
        shape = self.shapes.setdefault(layer, k.shape)
        rows = self.rows if keys else None  # step 0 covers every position
        want = shape if rows is None else (*shape[:2], rows.shape[1], shape[3])
        if want != k.shape or (rows is not None and rows.shape[1] > keys[-1].shape[2]):
            raise ValueError(f"TTTCache: step {len(keys)} of layer {layer} has keys {list(k.shape)}, expected "
                             f"{list(want)} (step 0 covers the S positions, a later one its rows, at most the "
                             "step before's)")
        keys.append(_expand(q, k))
        values.append(_expand(q, v))
        return _attend(q, keys, values, rows)
