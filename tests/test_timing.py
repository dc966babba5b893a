"""eaglekit.timing's view of a shared CPU: the CPUs other work keeps busy (from /proc/stat), the torch
threads that leaves, and the passive OpenMP wait a child process gets; and, on the real libgomp, that
passive waiting reaches a child (no timing claims here: benchmarks/RESULTS.md has the measurements); and
how often a Stopwatch waits for a GPU."""
import subprocess
import sys
import time

import pytest

from eaglekit import timing


def test_busy_cpus_from_two_readings_of_proc_stat(monkeypatch):
    """One CPU of two busy over the window (another process spinning), the other idle: 1.0 of 2."""
    readings = iter([{0: (100, 1000), 1: (500, 1000)}, {0: (200, 1100), 1: (500, 1100)}])
    monkeypatch.setattr(timing, "cpu_ticks", lambda cpus: next(readings))
    monkeypatch.setattr(timing, "own_ticks", lambda: 0)
    monkeypatch.setattr(timing.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(timing.time, "sleep", lambda s: None)
    assert timing.busy_cpus(samples=1) == (1.0, 2)
    monkeypatch.setattr(timing, "cpu_ticks", lambda cpus: None)  # no /proc/stat: no claim
    assert timing.busy_cpus() is None


def test_busy_cpus_leaves_out_its_own_work_and_a_burst_that_ended(monkeypatch):
    """This process's own ticks are not other work; the least busy window counts (a setup step ending)."""
    ticks = iter([{0: (0, 0), 1: (0, 0)}, {0: (100, 100), 1: (100, 100)},  # window 1: both busy, half ours
                  {0: (100, 100), 1: (100, 100)}, {0: (200, 200), 1: (110, 200)}])  # window 2: one busy, ours
    own = iter([0, 100, 0, 100])
    monkeypatch.setattr(timing, "cpu_ticks", lambda cpus: next(ticks))
    monkeypatch.setattr(timing, "own_ticks", lambda: next(own))
    monkeypatch.setattr(timing.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(timing.time, "sleep", lambda s: None)
    busy, n = timing.busy_cpus(samples=2)
    assert n == 2 and busy == pytest.approx(0.1)  # window 1: 1.0 others; window 2: 0.1; the least counts


def test_busy_cpus_sees_a_real_competitor():
    import os

    if not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs /proc/stat and 2 CPUs")
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        busy, _ = timing.busy_cpus(0.3, samples=2)
    finally:
        spin.kill()
        spin.wait()
    assert busy >= 0.6  # one process spinning on one core is read as (about) one busy CPU


def test_cpu_ticks_reads_this_machine():
    import os

    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    cpus = os.sched_getaffinity(0)
    ticks = timing.cpu_ticks(cpus)
    assert set(ticks) == cpus and all(0 <= busy <= total for busy, total in ticks.values())
    busy, n = timing.busy_cpus(0.05)
    assert n == len(cpus) and 0.0 <= busy <= n


def test_threads_for_the_free_cpus():
    assert timing.threads_for(2, 0.0) == 2
    assert timing.threads_for(2, 1.0) == 1  # one other process on one of two cores
    assert timing.threads_for(2, 0.4) == 2 and timing.threads_for(2, 0.6) == 1  # more than half free counts
    assert timing.threads_for(2, 5.0) == 1  # never none
    assert timing.threads_for(16, 3.2) == 13


def test_thread_env_waits_passively_unless_told_otherwise():
    assert timing.thread_env(3, {}) == {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "PASSIVE"}
    assert timing.thread_env(1, {"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"


def test_a_child_gets_the_threads_and_wait_policy():
    code = "import os, torch; print(torch.get_num_threads(), os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", code], env={**timing.thread_env(1, {}), "PATH": ""},
                         capture_output=True, text=True, check=True, timeout=120).stdout.split()
    assert out == ["1", "PASSIVE"]


def test_load_average():
    load = timing.load_average()
    assert load is None or (len(load) == 3 and all(x >= 0 for x in load))


def test_stopwatch_syncs_a_cuda_device_once_per_reading(monkeypatch):
    """torch.cuda.synchronize counted (patched: no GPU needed): a two-lap stopwatch waits at its start and at
    each lap, three times; one started with ``synced=True`` (the caller has just waited) twice; a CPU none."""
    waits = []
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda device=None: waits.append(device))
    for device, synced, expected in [("cuda", False, 3), ("cuda", True, 2), ("cpu", False, 0)]:
        waits.clear()
        watch = timing.Stopwatch(device, synced=synced)
        assert watch.lap() >= 0 and watch.lap() >= 0
        assert len(waits) == expected, (device, synced, waits)
