"""Atomic file writes: every file eaglekit writes goes to a temporary name in the same folder and is
renamed onto its final name only when complete, so a crash never leaves a half file that looks whole
(``publish_dir`` does the same for a folder written whole under a temporary name)."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path


def atomic_write(path: str | Path, write: Callable[[str], object]) -> Path:
    """Call ``write(tmp_path)`` then rename onto ``path`` (fsynced); on any error the temp file is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a unique name the writer creates itself, so the file gets the usual umask permissions (mkstemp: 0600)
    tmp = str(path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def write_bytes(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def write_json(path: str | Path, data, indent: int = 2) -> Path:
    return write_text(path, json.dumps(data, indent=indent, sort_keys=False) + "\n")


def write_safetensors(path: str | Path, tensors: dict, metadata: dict | None = None) -> Path:
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    from safetensors.torch import save_file  # here: the engines' installers import this module without torch

    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata or {"format": "pt"}))


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_dir(tmp: str | Path, final: str | Path) -> Path:
    """Rename folder ``tmp``, written complete, onto ``final`` (an older ``final`` is removed first), both
    fsynced: a crash leaves no folder under ``final`` that looks whole but is not."""
    tmp, final = Path(tmp), Path(final)
    fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


@contextlib.contextmanager
def held(lock_path: str | Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock_path`` for the block: a second process making the same thing waits for
    the first to finish instead of making it again beside it (the lock goes with the process if it dies)."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        yield


def made_once(folder: Path, find: Callable[[], Path | None], make: Callable[[], Path]) -> Path:
    """``find()`` if the thing installed in ``folder`` is already there, else ``make()`` it under an exclusive
    lock beside the folder (``held``): a process arriving while another makes it waits, then finds it."""
    if (found := find()) is not None:
        return found
    with held(folder.parent / f".{folder.name}.lock"):
        return find() or make()
