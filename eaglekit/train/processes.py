"""A run's processes: the error every rank raises together, what ranks exchange, one run per output
directory, and workers that die with their launcher. Light on purpose (no torch at import): ``train.cli``
imports it before anything heavy, so a worker can arm ``exit_with_launcher`` first.

``TrainError``: a deliberate stop, raised by every rank at the same point, told by one.

``reduce_sum`` / ``gather_text``: numbers summed over ranks, text gathered from every rank (byte tensors:
no pickle between processes).

``OutputDirLock``: an exclusive ``flock`` on ``<output_dir>/.eaglekit-train.lock``, taken by the main
process for the whole run; the OS drops it when that process ends, however it ends (kill -9 included),
so a stale lock file never blocks anyone. The file records the holder's pid and host for the message a
second run gets.

``exit_with_launcher``: torch elastic (``accelerate launch``, ``torchrun``) starts workers in their own
session, so killing the launcher leaves them training and writing. A worker asks Linux for SIGKILL when
its parent dies (``prctl(PR_SET_PDEATHSIG)``; it fires when the parent *thread* that started the worker
ends, which for torch elastic is the launcher's main thread) and also polls its parent id (other systems).
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

LOCK_NAME = ".eaglekit-train.lock"
PR_SET_PDEATHSIG = 1


class TrainError(RuntimeError):
    """A run stopped on purpose (bad state, busy dir, changed config). Under several processes every rank
    raises it at the same point; only one carries the message (``quiet`` on the others)."""

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


def reduce_sum(acc, values: list[float]) -> list[float]:
    """``values`` summed over every rank (float64), as a list; as they are in one process."""
    import torch  # here, not at the top: see the module's docstring

    t = torch.tensor(values, dtype=torch.float64, device=acc.device)
    return acc.reduce(t, reduction="sum").tolist() if acc.num_processes > 1 else t.tolist()


def gather_text(acc, text: str) -> list[str]:
    """Every rank's ``text`` on every rank (as padded byte tensors: no pickle between processes)."""
    if acc.num_processes == 1:
        return [text]
    import torch

    data = torch.tensor(list(text.encode()), dtype=torch.int64, device=acc.device)
    sizes = acc.gather(torch.tensor([data.numel()], device=acc.device)).tolist()
    padded = torch.zeros(max(1, max(sizes)), dtype=torch.int64, device=acc.device)
    padded[:data.numel()] = data
    rows = acc.gather(padded[None]).tolist()
    return [bytes(row[:n]).decode(errors="replace") for row, n in zip(rows, sizes)]


class OutputDirLock:
    """Hold ``<output_dir>/.eaglekit-train.lock`` exclusively, or raise TrainError naming the holder."""

    def __init__(self, output_dir: str | Path):
        self.dir = Path(output_dir)
        self.path = self.dir / LOCK_NAME
        self._fh = None

    def acquire(self) -> OutputDirLock:
        self.dir.mkdir(parents=True, exist_ok=True)
        # not an atomic write: the lock lives on this very inode, so it is opened in place, never replaced
        fh = open(self.path, "a+")  # noqa: SIM115 -- held open for the whole run: the open file is the lock
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(self.path)
            fh.close()
            raise TrainError(f"output_dir {self.dir} is in use by another training run{holder} (lock {self.path}); "
                             "wait for it to end or choose another output_dir") from None
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}) + "\n")
        fh.flush()
        self._fh = fh
        return self

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()  # closing the file drops the flock
            self._fh = None

    @property
    def held(self) -> bool:
        return self._fh is not None


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return ""
    if "pid" not in info:
        return ""
    return f" (pid {info['pid']} on {info.get('host', '?')})"


def launched_worker() -> bool:
    """True in a process started by torch elastic (accelerate launch / torchrun)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


_watching = False


def exit_with_launcher(poll_s: float = 1.0) -> bool:
    """In a launched worker, die when the launcher does; returns whether it was armed. A process run by
    hand (``python train_head.py``, maybe under nohup) is left alone: its parent is only a shell."""
    global _watching
    if not launched_worker() or _watching:
        return _watching
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still works
    if os.getppid() != parent:  # the launcher died between reading its pid and the request
        os._exit(1)

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(f"[eaglekit.train] launcher (pid {parent}) is gone: worker {os.getpid()} exits", file=sys.stderr,
              flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="eaglekit-launcher-watch", daemon=True).start()
    _watching = True
    return True
