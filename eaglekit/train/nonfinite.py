"""Non-finite values stop a run: a NaN/Inf loss or gradient norm on any rank stops every rank at the same
step with one message (from the main process) naming the step and where each bad batch came from; a head
with NaN/Inf weights is never written (checkpoint or ``final/``)."""
from __future__ import annotations

import math

import torch

from eaglekit.train.processes import TrainError, gather_text


def as_float(value) -> float:
    """A loss / norm (tensor, number or None = nothing to check) as a float."""
    if value is None:
        return 0.0
    return float(value.detach() if isinstance(value, torch.Tensor) else value)


def stop_if_not_finite(acc, what: str, value, origins: list[str], step: int, step_taken: bool = False) -> None:
    """Every rank calls this at the same point; all return, or all raise TrainError together.

    ``step`` is the optimizer steps already done (the failing one is ``step + 1``); ``step_taken`` says
    the optimizer already ran (DeepSpeed steps inside its backward pass)."""
    v = as_float(value)
    bad = not math.isfinite(v)
    flag = torch.tensor([float(bad)], device=acc.device)
    if acc.num_processes > 1:
        flag = acc.reduce(flag, reduction="sum")
    if not flag.item():
        return
    seen = [t for t in gather_text(acc, f"{v} on " + ", ".join(origins) if bad else "") if t]
    done = "DeepSpeed already took the step, but nothing is saved from it" if step_taken else \
        "stopped before the optimizer step"
    kept = f"the newest checkpoint is at or before step {step}" if step else "none was"
    raise TrainError(f"non-finite {what} at step {step + 1} ({'; '.join(seen)}): {done}; no checkpoint or final/ "
                     f"is written with these weights ({kept})", quiet=not acc.is_main_process)


def refuse_non_finite_weights(acc, state: dict, step: int, what: str) -> dict:
    """``state`` (the whole head, the same on every rank) unless a tensor holds NaN/Inf: then every rank
    raises TrainError naming the tensors and what was not written."""
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise TrainError(f"head weight(s) {', '.join(bad[:5])} hold NaN/Inf at step {step}: not writing {what}",
                         quiet=not acc.is_main_process)
    return state
