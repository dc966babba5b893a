"""Pre-packed oneDNN linears for decoding on a CPU.

aten's CPU ``linear`` multiplies by the row-major weight on every call. For the few rows a decoder
forward has (1 token in plain decoding, a 4–16-node tree in verification) that is far from the memory
bound. With each weight reordered once into oneDNN's blocked layout (the kernels torch.compile's CPU
freezing pass emits) these few-row forwards run faster, with outputs equal up to float rounding
(benchmarks/bench_packed_linear.py; figures in benchmarks/RESULTS.md, "Where the time goes").
Plain decoding gets faster and a verify forward costs less relative to one token, which is what
speculative decoding lives on: on MKL, aten's linear over a verify pass's 2-5 rows can cost several times one
row's product (the measurement: benchmarks/RESULTS.md, "Figures the code's comments used to carry").

Decoding only: the packed copy is made once and does not follow later edits of the weight, and calls
that need autograd (training) run aten's linear on the live weight. ``unpack_linears`` undoes it.
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)
ROWS_HINT = 16  # the row count oneDNN tunes the layout for; any count runs


def available() -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 and arm CPU wheels do)."""
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available()) and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise"))


@functools.cache
def dtype_supported(dtype: torch.dtype) -> bool:
    """Whether this CPU packs ``dtype``: oneDNN's bf16 path needs avx512 (bw/vl/dq) or avx_ne_convert, so
    a bf16 model on an older x86 CPU keeps aten's linear instead of failing. Probed once per dtype."""
    if dtype not in PACKED_DTYPES or not available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), ROWS_HINT)
    except RuntimeError:
        return False
    return True


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    needs_grad = torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad)
    if needs_grad or x.dtype != self.weight.dtype or x.device.type != "cpu":
        return F.linear(x, self.weight, self.bias)
    return torch.ops.mkldnn._linear_pointwise(x, self._eaglekit_packed, self.bias, "none", [], "")


def _packable(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (isinstance(m, nn.Linear) and w is not None and w.device.type == "cpu"
            and dtype_supported(w.dtype) and not hasattr(m, "_eaglekit_packed"))


def pack_linears(module: nn.Module, rows_hint: int = ROWS_HINT) -> int:
    """Give every CPU fp32/bf16 ``nn.Linear`` in ``module`` a packed copy of its weight and a forward
    that uses it. Returns how many linears are packed now (0 where oneDNN is missing or off-CPU; a dtype
    this CPU cannot pack keeps aten's linear)."""
    if not available():
        return 0
    with torch.no_grad():
        for m in module.modules():
            if _packable(m):
                m._eaglekit_packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), rows_hint)
                m.forward = types.MethodType(_packed_forward, m)
    return packed_count(module)


def unpack_linears(module: nn.Module) -> None:
    """Drop the packed copies: every linear runs aten's ``linear`` on its weight again."""
    for m in module.modules():
        if hasattr(m, "_eaglekit_packed"):
            del m._eaglekit_packed
            del m.forward  # the instance attribute; the class's forward shows through again


def packed_count(module: nn.Module) -> int:
    return sum(1 for m in module.modules() if hasattr(m, "_eaglekit_packed"))
