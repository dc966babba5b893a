"""Full-state checkpoints through ``accelerator.save_state``: head, optimizer (ZeRO shards included),
scheduler, the trainer's position in the data, and every rank's RNG states.

A checkpoint is written under ``checkpoints/.tmp-step-N`` and renamed to ``checkpoints/step-N`` only
when every rank has finished writing, so a crash (kill -9) never leaves a half checkpoint that looks
whole; ``resume=auto`` picks the highest complete ``step-N``; only the last ``keep_last`` are kept.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class TrainState:
    """What the loop needs to continue exactly: optimizer steps done and the data position."""
    step: int = 0  # optimizer steps completed
    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps done within ``epoch``
    tokens: int = 0  # supervised tokens seen (all ranks)
    seconds: float = 0.0  # wall time spent in the loop, counted only under optim.max_minutes

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def resolve_resume(resume: str, output_dir: str | Path) -> Path | None:
    """``auto`` → latest complete checkpoint (or None); ``none`` → None; else the given directory."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(output_dir)
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"resume: checkpoint directory {path} does not exist")
    return path


def save_checkpoint(accelerator, output_dir: str | Path, step: int, keep_last: int) -> Path:
    """Write a full-state checkpoint atomically; every rank must call this."""
    root = checkpoint_root(output_dir)
    tmp, final = root / f".tmp-step-{step}", root / f"step-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _fsync_tree(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
