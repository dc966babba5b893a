"""A checkpoint's files: how one is laid out, written atomically, checked, chosen and read — head weights,
optimizer (ZeRO partitions included), scheduler, the trainer's position in the data, every rank's RNG
states and the resolved run config, without pickle. What the trainer puts in and takes out is
``checkpoint_trainer``; how nested state becomes safetensors + JSON is ``checkpoint_tree``.

Layout of ``checkpoints/step-N/``::

    model.safetensors                      the whole head (main process)
    optimizer.safetensors + .json          optimizer state (DDP / one process: written once)
    optimizer-rank{r}.safetensors + .json  ZeRO: each rank's partition
    rng-rank{r}.safetensors + .json        each rank's Python / NumPy / torch RNG states
    trainer_state.json                     loop position, scheduler, Accelerate's accumulation counter
    train_config.json                      the resolved config of the run that wrote it
    checkpoint.json                        written last: every file's size and sha256

A checkpoint is written under ``checkpoints/.tmp-step-N`` and renamed to ``step-N`` only when every rank
has finished writing, so a crash (kill -9) never leaves a half checkpoint that looks whole. Resuming
checks ``checkpoint.json`` first: a truncated or altered file is named and ``resume=auto`` falls back to
the previous checkpoint; a pickle file (``.pkl``, ``.pt``, ``.bin``…) is never loaded — the checkpoint is
refused. Only the last ``keep_last`` checkpoints are kept.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from eaglekit.fileio import publish_dir, write_json, write_safetensors, write_text
from eaglekit.train.checkpoint_tree import from_json, load_tree, rng_state, save_tree, to_json
from eaglekit.train.processes import TrainError

STEP_DIR = re.compile(r"^step-(\d+)$")
FORMAT = "eaglekit-checkpoint/1"
MANIFEST = "checkpoint.json"
PICKLE_SUFFIXES = (".pkl", ".pickle", ".pt", ".pth", ".bin")  # torch.save / pickle formats: never loaded
# Fields that do not change what is trained: how the run is resumed, shown, logged and checkpointed, and
# where it writes. Every other difference between the checkpoint's config and this run's is reported.
RESUME_FREE_FIELDS = ("resume", "resume_allow_changes", "output_dir", "progress", "trackers", "log_interval",
                      "save_interval", "keep_last", "eval_interval",
                      "data.load_target_decoder", "data.keep_target_rows")  # the same steps either way (tested)


class CheckpointError(TrainError):
    """A checkpoint that cannot be resumed from (incomplete, altered, holding pickles)."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoints renamed into place (``step-N``), oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


# ---- writing -------------------------------------------------------------------------------------
def save_checkpoint(acc, output_dir: str | Path, step: int, keep_last: int,
                    write_files: Callable[[Path], None]) -> Path:
    """Write a checkpoint atomically; every rank calls this and ``write_files(folder)`` writes its part."""
    root = checkpoint_root(output_dir)
    tmp, final = root / f".tmp-step-{step}", root / f"step-{step}"
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    write_files(tmp)
    acc.wait_for_everyone()
    if acc.is_main_process:
        write_manifest(tmp, step, acc.num_processes)
        publish_dir(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return final


def write_rank_files(folder: Path, acc, *, model: dict, optimizer: dict, sharded: bool, trainer: dict,
                     config: dict) -> None:
    """This rank's files: its RNG states (and ZeRO optimizer partition); the main process adds the head,
    the replicated optimizer state, the loop state and the config."""
    rank = acc.process_index
    save_tree(folder / f"rng-rank{rank}", rng_state())
    if sharded:
        save_tree(folder / f"optimizer-rank{rank}", optimizer, skip_unknown=True)
    if acc.is_main_process:
        write_safetensors(folder / "model.safetensors", model)
        if not sharded:
            save_tree(folder / "optimizer", optimizer)
        write_text(folder / "trainer_state.json", to_json(trainer))
        write_json(folder / "train_config.json", config)


def write_manifest(folder: Path, step: int, processes: int) -> None:
    files = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)}
             for f in sorted(folder.iterdir()) if f.is_file() and f.name != MANIFEST}
    write_json(folder / MANIFEST, {"format": FORMAT, "step": step, "processes": processes, "files": files})


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# ---- checking and choosing -----------------------------------------------------------------------
def pickles_in(path: Path) -> list[Path]:
    return sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in PICKLE_SUFFIXES)


def refuse_pickles(path: Path) -> None:
    found = pickles_in(path)
    if found:
        names = ", ".join(str(f.relative_to(path)) for f in found[:5])
        raise CheckpointError(
            f"checkpoint {path} holds pickle file(s) ({names}): refusing to load it (unpickling can run any code; "
            "eaglekit checkpoints are safetensors + JSON). Remove the checkpoint, or start over with resume=none")


def verify_checkpoint(path: Path) -> dict:
    """Check every file against ``checkpoint.json``; returns the manifest or raises CheckpointError."""
    refuse_pickles(path)
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is missing (not a complete eaglekit checkpoint)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: {manifest_path.name} is unreadable ({e})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} is missing")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint {path}: file {name} is truncated or altered "
                                  f"({size} bytes, {want['bytes']} written)")
        if _sha256(f) != want["sha256"]:
            raise CheckpointError(f"checkpoint {path}: file {name} is corrupt (sha256 differs from the one written)")
    return manifest


def choose_checkpoint(resume: str, output_dir: str | Path, say: Callable[[str], None]) -> Path | None:
    """``none`` → None; a directory → it, verified; ``auto`` → the newest checkpoint that verifies, saying
    why each newer one was passed over (a checkpoint holding pickles stops the run instead)."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"resume: checkpoint directory {path} does not exist")
        verify_checkpoint(path)
        return path
    found = list_checkpoints(output_dir)
    for i in range(len(found) - 1, -1, -1):
        refuse_pickles(found[i])
        try:
            verify_checkpoint(found[i])
            return found[i]
        except CheckpointError as e:
            older = f"falling back to {found[i - 1].name}" if i else "no older checkpoint to fall back to"
            say(f"[eaglekit.train] {e}; {older}")
    if found:
        raise CheckpointError(f"resume=auto: no usable checkpoint in {checkpoint_root(output_dir)} (see above); "
                              "remove the damaged ones or start over with resume=none")
    return None


# ---- reading -------------------------------------------------------------------------------------
def read_trainer_state(path: Path) -> dict:
    return from_json((path / "trainer_state.json").read_text(), "trainer_state")


def read_config(path: Path) -> dict:
    return json.loads((path / "train_config.json").read_text())


def read_optimizer(path: Path, rank: int, sharded: bool, like: dict | None = None) -> dict:
    stem = path / (f"optimizer-rank{rank}" if sharded else "optimizer")
    if not stem.with_name(stem.name + ".json").is_file():
        raise CheckpointError(f"checkpoint {path}: no {stem.name}.json — it was written "
                              f"{'without ZeRO' if sharded else 'under ZeRO'} or by fewer processes than this run")
    return load_tree(stem, like)


def read_rng(path: Path, rank: int) -> dict | None:
    stem = path / f"rng-rank{rank}"
    return load_tree(stem) if stem.with_name(stem.name + ".json").is_file() else None


# ---- config changes and the log --------------------------------------------------------------------
def config_changes(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(dotted key, saved value, current value) for every field that differs, free fields excepted."""
    a, b = _flat(saved), _flat(json.loads(json.dumps(current)))  # as stored: tuples read back as lists
    keys = sorted(set(a) | set(b))
    missing = object()
    out = []
    for k in keys:
        if k in RESUME_FREE_FIELDS:
            continue
        old, new = a.get(k, missing), b.get(k, missing)
        if old != new:
            out.append((k, None if old is missing else old, None if new is missing else new))
    return out


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def trim_log(path: Path, step: int) -> int:
    """Keep the training records of ``log.jsonl`` up to ``step`` (a resumed run logs the later ones again);
    drop an earlier end-of-run record (the resumed run writes its own) and a line a kill cut short.
    Returns how many lines were dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if isinstance(rec, dict) and rec.get("step", 0) <= step and not rec.get("final"):
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        write_text(path, "".join(f"{line}\n" for line in kept))
    return dropped
