"""Wall-clock timing that counts a device's queued work: CUDA kernels run asynchronously, so each reading
first waits for them (on a CPU there is nothing to wait for). And how busy the CPUs are: the load, the
CPUs other work keeps busy, and the torch threads and OpenMP wait policy that leave a busy machine's
slowdown in proportion to the CPU taken."""
from __future__ import annotations

import os
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
    """Seconds since the last ``lap()`` (and since the start, ``elapsed()``), the device synced once at each
    reading, and at the start (the caller's earlier queued kernels are not the timed work's) unless
    ``synced``: the caller has just waited for the device itself (a decode step started right after the
    previous step's last lap), so a second wait would find nothing queued and only cost a host round trip.
    A step timed in two laps then syncs twice, not three times; on a CPU nothing is synced either way."""

    def __init__(self, device: torch.device | str | None = None, synced: bool = False):
        self.device = device
        if not synced:
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


# ---- CPU threads on a shared machine -----------------------------------------------------------------
# With more OpenMP threads than free cores, a thread that reaches a barrier spins (libgomp's default
# OMP_WAIT_POLICY) on the core its preempted peer could have run on, so every parallel region waits for a
# time slice of a busy core: measured here beside other processes, a training step 0.36 s -> 3.4 s and a
# decode 4.2 s -> 25 s at 2 threads (benchmarks/RESULTS.md, "Threads on a busy CPU"). Passive waiting
# gives the core back, and fewer threads than busy cores leave nobody to wait for.

def cpu_ticks(cpus) -> dict[int, tuple[int, int]] | None:
    """cpu -> (busy, total) clock ticks since boot, from /proc/stat (None where it cannot be read)."""
    try:
        with open("/proc/stat") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            out[int(name[3:])] = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))
    return out


def own_ticks() -> int:
    """Clock ticks this process (all its threads) has run, user + system (0 where /proc/self/stat is absent)."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of proc(5))


def busy_cpus(interval: float = 0.5, samples: int = 3) -> tuple[float, int] | None:
    """(how many of this process's CPUs other work keeps busy, how many CPUs it may run on): e.g. (1.0, 2)
    beside one process spinning on one of two cores. None without /proc/stat.

    The least busy of ``samples`` windows of ``interval`` seconds, this process's own ticks left out: work
    that just ended (a setup step, this process's imports) is not read as a competitor, one that goes on
    is."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    found = []
    for _ in range(max(1, samples)):
        before, mine = cpu_ticks(cpus), own_ticks()
        time.sleep(interval)
        after, mine = cpu_ticks(cpus), own_ticks() - mine
        if not before or not after:
            return None
        busy = sum(after[c][0] - before[c][0] for c in after if c in before) - mine
        total = sum(after[c][1] - before[c][1] for c in after if c in before)
        found.append(max(0.0, len(cpus) * busy / total) if total else 0.0)
    return min(found), len(cpus)


def threads_for(cpus: int, busy: float) -> int:
    """Torch threads for ``cpus`` CPUs of which ``busy`` are taken by other work: one per free CPU (a CPU
    more than half free counts), at least one."""
    return max(1, min(cpus, round(cpus - busy)))


def thread_env(threads: int, environ=None) -> dict[str, str]:
    """Environment for a child process (set before its OpenMP starts): ``threads`` OpenMP threads waiting
    passively (asleep, not spinning) at barriers, unless the caller's environment chose a wait policy."""
    environ = os.environ if environ is None else environ
    return {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": environ.get("OMP_WAIT_POLICY", "PASSIVE")}
