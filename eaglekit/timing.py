"""Wall-clock timing that counts a device's queued work: CUDA kernels run asynchronously, so each reading
first waits for them (on a CPU there is nothing to wait for)."""
from __future__ import annotations

import time

import torch


def sync(device: torch.device | str | None = None) -> None:
    """Wait until ``device`` (every CUDA device when None) has finished its queued kernels."""
    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Seconds since the last ``lap()`` (and since the start, ``elapsed()``), the device synced at each reading
    and at the start (the caller's earlier queued kernels are not the timed work's)."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = device
        sync(device)
        self.start = self.last = time.perf_counter()

    def lap(self) -> float:
        sync(self.device)
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds

    def elapsed(self) -> float:
        sync(self.device)
        return time.perf_counter() - self.start


def timed(fn, device: torch.device | str | None = None):
    """``(fn(), seconds)``, the device synced before and after."""
    watch = Stopwatch(device)
    result = fn()
    return result, watch.lap()


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (/proc/loadavg: runnable processes, ours included); None where
    the file does not exist (not Linux)."""
    try:
        with open("/proc/loadavg") as fh:
            return [float(x) for x in fh.read().split()[:3]]
    except OSError:
        return None
