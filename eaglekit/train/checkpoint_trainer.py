"""A Trainer into a checkpoint and back: what it writes (head, optimizer — ZeRO partitions per rank —,
scheduler, loop position ``TrainState``, RNG, config) and how a run continues from one (the files
themselves: ``checkpoint_files``).

Resume rules: the newest checkpoint that passes its checksums (``resume=auto``; a damaged one is named and
passed over); the config it was written with must match this run's except the fields in
``RESUME_FREE_FIELDS`` — otherwise the differences are listed and the run refused, unless
``resume_allow_changes=true``, which applies them (learning rate, betas, weight decay and the schedule's
length take the new values) and records them in the first ``log.jsonl`` row after the resume. Records
of ``log.jsonl`` after the resumed step are dropped, so no step is logged twice.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path

from safetensors.torch import load_file

from eaglekit.config import ConfigError, load_config, to_dict
from eaglekit.train.checkpoint_files import (
    CheckpointError,
    checkpoint_root,
    choose_checkpoint,
    config_changes,
    read_config,
    read_optimizer,
    read_rng,
    read_trainer_state,
    save_checkpoint,
    trim_log,
    write_rank_files,
)
from eaglekit.train.checkpoint_tree import set_rng_state
from eaglekit.train.config import TrainConfig
from eaglekit.train.processes import TrainError, reduce_sum


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


def zero_engine(tr):
    """The DeepSpeed engine under ZeRO (its optimizer holds this rank's partition), else None."""
    return tr.model if tr.acc.state.deepspeed_plugin is not None else None


def _zero_stage(tr) -> int:
    plugin = tr.acc.state.deepspeed_plugin
    return plugin.zero_stage if plugin is not None else 0


def save_trainer(tr, weights: dict) -> Path:
    """Write checkpoint ``step-N`` of trainer ``tr`` (every rank calls this); ``weights`` is the whole
    head, already checked finite."""
    engine = zero_engine(tr)
    optimizer = engine.optimizer.state_dict() if engine is not None else tr.opt.state_dict()
    trainer = {"loop": tr.state.state_dict(), "scheduler": tr.scheduler.state_dict(),
               "accumulate_step": tr.acc.step, "processes": tr.acc.num_processes}
    write = functools.partial(write_rank_files, acc=tr.acc, model=weights, optimizer=optimizer,
                              sharded=engine is not None, trainer=trainer, config=to_dict(tr.cfg))
    return save_checkpoint(tr.acc, tr.out, tr.state.step, tr.cfg.keep_last, write)


def resume_trainer(tr) -> dict:
    """Continue from the checkpoint ``cfg.resume`` names, if any; returns the config changes applied
    ({key: [old, new]}, empty when none)."""
    path = _choose(tr)
    if path is None:
        if tr.acc.is_main_process:
            trim_log(tr.log_path, 0)  # a fresh start: an earlier run's records would repeat its steps
        return {}
    changes = config_changes(stored_config(path), to_dict(tr.cfg))
    if changes and not tr.cfg.resume_allow_changes:
        listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changes)
        raise TrainError(f"resume from {path}: the config differs from the one this checkpoint was written with "
                         f"({listed}); set resume_allow_changes=true to apply the new values, or resume=none "
                         "to start over", quiet=not tr.acc.is_main_process)
    load(tr, path)
    if changes:
        apply_changes(tr)
        tr.acc.print(f"[eaglekit.train] resume_allow_changes=true: applying {len(changes)} config change(s) "
                     "from the checkpoint's: " + "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changes))
    dropped = trim_log(tr.log_path, tr.state.step) if tr.acc.is_main_process else 0
    tr.acc.print(f"[eaglekit.train] resumed from {path} at step {tr.state.step}"
                 + (f" (dropped {dropped} log.jsonl record(s) past it)" if dropped else ""))
    return {k: [old, new] for k, old, new in changes}


def stored_config(path: Path) -> dict:
    """The config checkpoint ``path`` was written with, in today's shape: a ``target: NAME`` as the section,
    fields added since at their defaults. A config that no longer loads is compared as stored."""
    saved = read_config(path)
    try:
        return to_dict(load_config(TrainConfig, None, saved))
    except ConfigError:
        return saved


def _choose(tr) -> Path | None:
    """The main process checks the checkpoints (checksums) and tells the others which one to load."""
    code, error = 0.0, None
    if tr.acc.is_main_process:
        try:
            path = choose_checkpoint(tr.cfg.resume, tr.out, tr.acc.print)
            code = 0.0 if path is None else (-1.0 if tr.cfg.resume != "auto" else float(_step_of(path)) + 1)
        except CheckpointError as e:
            code, error = -2.0, e
    code = reduce_sum(tr.acc, [code])[0] if tr.acc.num_processes > 1 else code
    if code == -2:
        raise error or TrainError("resume: the main process refused the checkpoint", quiet=True)
    if code == 0:
        return None
    return Path(tr.cfg.resume) if code == -1 else checkpoint_root(tr.out) / f"step-{int(code) - 1}"


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def load(tr, path: Path) -> None:
    """Restore head, optimizer, scheduler, loop position, Accelerate's counter and this rank's RNG."""
    rank, engine = tr.acc.process_index, zero_engine(tr)
    if _zero_stage(tr) != 3:  # under ZeRO-3 the partitions below carry the weights
        tr.acc.unwrap_model(tr.model).load_state_dict(load_file(str(path / "model.safetensors")))
    if engine is not None:
        zero = engine.optimizer
        state = read_optimizer(path, rank, sharded=True, like=zero.state_dict())
        if hasattr(zero, "checkpoint_event_prologue"):
            zero.checkpoint_event_prologue()
        zero.load_state_dict([state] * tr.acc.num_processes, load_optimizer_states=True, load_from_fp32_weights=True)
        if hasattr(zero, "checkpoint_event_epilogue"):
            zero.checkpoint_event_epilogue()
    else:
        tr.opt.load_state_dict(read_optimizer(path, rank, sharded=False))
    saved = read_trainer_state(path)
    tr.scheduler.load_state_dict(saved["scheduler"])
    tr.state.load_state_dict(saved["loop"])
    tr.acc.step = saved["accumulate_step"]
    rng = read_rng(path, rank)
    if rng is None:
        tr.acc.print(f"[eaglekit.train] {path} holds no RNG state for rank {rank} (written by "
                     f"{saved['processes']} processes): this rank keeps its own")
    else:
        set_rng_state(rng)


def apply_changes(tr) -> None:
    """After loading a checkpoint: the optimizer and schedule take this run's config, not the saved one."""
    o = tr.cfg.optim
    groups = tr.scheduler.optimizer.param_groups
    factor = tr.scheduler.lr_lambdas[0](tr.scheduler.last_epoch)
    tr.scheduler.base_lrs = [o.lr] * len(groups)
    for g in groups:
        g.update(initial_lr=o.lr, lr=o.lr * factor, betas=tuple(o.betas), weight_decay=o.weight_decay)
    tr.scheduler._last_lr = [g["lr"] for g in groups]
    engine = zero_engine(tr)
    if engine is not None and hasattr(engine.optimizer, "clip_grad"):  # ZeRO-1/2 keep the saved clip value
        engine.optimizer.clip_grad = o.grad_clip
