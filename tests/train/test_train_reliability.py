"""Trust in training runs: checkpoints hold no pickle (and a planted one is refused, never loaded), a
damaged checkpoint is named and passed over, a changed config is refused unless allowed, log.jsonl never
repeats a step, a non-finite loss / gradient stops the run before anything is written, and one run owns
its output_dir (the lock; workers that die with their launcher)."""
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from helpers import save_tiny, tiny_conversations, train_command
from safetensors.torch import load_file

import eaglekit.train.data as data_mod
from eaglekit.train.build import lr_lambda
from eaglekit.train.checkpoint_files import (
    PICKLE_SUFFIXES,
    CheckpointError,
    list_checkpoints,
    verify_checkpoint,
)
from eaglekit.train.config import load_train_config
from eaglekit.train.processes import LOCK_NAME, OutputDirLock, TrainError
from eaglekit.train.trainer import build_trainer, train

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: one thread, see conftest
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("reliable")
    save_tiny(d / "tiny", vocab_size=64, hidden=32, layers=4)
    tiny_conversations(d / "convs.jsonl", n=24)
    return d


def _args(d: Path, out: Path, *extra) -> list[str]:
    # EAGLE-1 with feature noise: the curve depends on the RNG, so a resume must restore it exactly
    return [f"target={d / 'tiny'}", f"data.conversations={d / 'convs.jsonl'}", "data.eval_samples=4",
            "head.kind=eagle1", "loss.ttt_steps=2", "loss.noise=0.2", "data.batch_size=2", "optim.lr=1e-3",
            "optim.max_steps=8", "save_interval=4", "keep_last=2", "eval_interval=0", "progress=false",
            "trackers=[]", f"output_dir={out}", *extra]


def _cfg(d: Path, out: Path, *extra):
    return load_train_config(None, _args(d, out, *extra))


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def _steps(out: Path) -> list[int]:
    return [r["step"] for r in _rows(out) if "final" not in r]


@pytest.fixture(scope="module")
def finished(tiny, tmp_path_factory):
    """An uninterrupted 8-step run with checkpoints at steps 4 and 8."""
    out = tmp_path_factory.mktemp("run") / "out"
    train(_cfg(tiny, out))
    return out


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(LOCK_NAME))
    return dst


# ---- item 4: no pickle ---------------------------------------------------------------------------
class _Planted:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):  # unpickling this creates ``marker``: proof that a pickle was loaded
        return (Path.touch, (self.marker,))


def test_checkpoints_hold_no_pickle_and_a_planted_pickle_is_refused(tiny, finished, tmp_path):
    files = [f for ck in list_checkpoints(finished) for f in ck.iterdir()]
    assert {ck.name for ck in list_checkpoints(finished)} == {"step-4", "step-8"}
    assert files and all(f.suffix in (".safetensors", ".json") for f in files), sorted(f.name for f in files)
    out = _copy_run(finished, tmp_path / "out")
    marker = tmp_path / "pickle-was-loaded"
    (out / "checkpoints/step-8/custom_checkpoint_0.pkl").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(CheckpointError, match=r"step-8.*custom_checkpoint_0\.pkl.*refusing"):
        train(_cfg(tiny, out))
    assert not marker.exists() and (out / "final").exists()
    assert {".pkl", ".pt", ".bin"} <= set(PICKLE_SUFFIXES)


# ---- item 7: a damaged checkpoint is named and passed over; the log never repeats a step ------------------
def test_truncated_newest_checkpoint_falls_back_and_log_keeps_each_step_once(tiny, finished, tmp_path, capsys):
    out = _copy_run(finished, tmp_path / "out")
    model = out / "checkpoints/step-8/model.safetensors"
    model.write_bytes(model.read_bytes()[:1000])
    capsys.readouterr()
    train(_cfg(tiny, out))
    said = capsys.readouterr()
    said = said.out + said.err
    assert "step-8: file model.safetensors is truncated" in said and "falling back to step-4" in said, said
    assert "resumed from" in said and "at step 4" in said
    assert _steps(out) == list(range(1, 9))  # 5..8 trained again, logged once
    ref = {r["step"]: r["loss"] for r in _rows(finished) if "final" not in r}
    assert {r["step"]: r["loss"] for r in _rows(out) if "final" not in r} == ref  # bit for bit
    a, b = load_file(str(finished / "final/model.safetensors")), load_file(str(out / "final/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    verify_checkpoint(out / "checkpoints/step-8")  # rewritten whole by the resumed run


def test_damaged_optimizer_file_named_and_explicit_resume_refused(finished, tmp_path):
    out = _copy_run(finished, tmp_path / "out")
    opt = out / "checkpoints/step-8/optimizer.safetensors"
    data = bytearray(opt.read_bytes())
    data[-5] ^= 0xFF  # same size, one byte changed
    opt.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step-8: file optimizer\.safetensors is corrupt"):
        verify_checkpoint(out / "checkpoints/step-8")
    opt.write_bytes(bytes(data[:-100]))
    with pytest.raises(CheckpointError, match=r"step-8: file optimizer\.safetensors is truncated"):
        verify_checkpoint(out / "checkpoints/step-8")
    (out / "checkpoints/step-4/checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match=r"step-4: checkpoint\.json is missing"):
        verify_checkpoint(out / "checkpoints/step-4")


# ---- item 6: the config travels with the checkpoint -------------------------------------------------------
def test_changed_config_refused_then_applied_when_allowed(tiny, finished, tmp_path):
    out = _copy_run(finished, tmp_path / "out")
    saved = json.loads((out / "checkpoints/step-8/train_config.json").read_text())
    assert saved["optim"]["lr"] == 1e-3 and saved["head"]["kind"] == "eagle1"
    changed = ["optim.lr=3e-3", "optim.max_steps=10", "optim.warmup_steps=2"]
    with pytest.raises(TrainError, match=r"optim\.lr: 0\.001 -> 0\.003.*optim\.max_steps: 8 -> 10"
                                         r".*resume_allow_changes=true"):
        train(_cfg(tiny, out, *changed))
    assert _steps(out) == list(range(1, 9)) and not (out / "checkpoints/step-10").exists()
    train(_cfg(tiny, out, *changed, "resume_allow_changes=true", "save_interval=0"))  # save_interval is free
    rows = [r for r in _rows(out) if "final" not in r]
    assert [r["step"] for r in rows] == list(range(1, 11))
    first = rows[8]
    assert first["config_changes"]["optim.lr"] == [1e-3, 3e-3]
    assert "save_interval" not in first["config_changes"]
    # the new lr and the new schedule's length apply from the resumed step on
    assert first["lr"] == pytest.approx(3e-3 * lr_lambda(10, 2, 0.0)(9), rel=1e-12)
    assert "config_changes" not in rows[9]
    finals = [r for r in _rows(out) if r.get("final")]
    assert [r["step"] for r in finals] == [10]  # the step-8 run's end record went with the resume


# ---- item 1 (trainer): non-finite values stop the run, nothing bad is written ----------------------------
def _poison_call(monkeypatch, n_train: int, at_call: int) -> list[int]:
    """Make the trainer's ``at_call``-th training fetch return NaN features; returns the poisoned indices."""
    real, calls, poisoned = data_mod.fetch, [0], []

    def fetch(source, indices):
        items = real(source, indices)
        if len(source) != n_train:
            return items
        calls[0] += 1
        if calls[0] != at_call:
            return items
        poisoned.extend(indices)
        return [dict(it, last=torch.full_like(it["last"], float("nan")), origin=f"poisoned-{i}")
                for i, it in zip(indices, items)]

    monkeypatch.setattr(data_mod, "fetch", fetch)
    return poisoned


def test_nan_loss_stops_before_the_step_naming_step_and_origin(tiny, tmp_path, monkeypatch, capsys):
    from eaglekit.train.cli import run

    out = tmp_path / "out"
    poisoned = _poison_call(monkeypatch, n_train=20, at_call=3)
    code = run(Namespace(config=None, overrides=_args(tiny, out, "save_interval=1", "keep_last=0")))
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("eaglekit: error:")]
    assert len(lines) == 1, err
    assert "non-finite loss at step 3" in lines[0]
    assert poisoned and all(f"poisoned-{i}" in lines[0] or f"sample {i}" in lines[0] for i in poisoned), lines[0]
    assert [c.name for c in list_checkpoints(out)] == ["step-1", "step-2"]
    assert not (out / "final").exists() and not (out / "metrics.json").exists()
    assert _steps(out) == [1, 2]


def test_nan_gradient_stops_and_nan_weights_are_never_written(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"
    tr = build_trainer(_cfg(tiny, out, "save_interval=1"))
    real, calls = tr.acc.clip_grad_norm_, [0]

    def clip(params, max_norm):
        norm = real(params, max_norm)
        calls[0] += 1
        return torch.tensor(float("inf")) if calls[0] == 2 else norm

    monkeypatch.setattr(tr.acc, "clip_grad_norm_", clip)
    with pytest.raises(TrainError, match=r"non-finite gradient norm at step 2 \(inf on .+\): stopped before the "
                                         r"optimizer step"):
        tr.fit()
    assert [c.name for c in list_checkpoints(out)] == ["step-1"]
    with torch.no_grad():
        tr.head.fc.weight[0, 0] = float("nan")
    with pytest.raises(TrainError, match=r"head\.fc\.weight hold NaN/Inf.*not writing .*final"):
        tr.save_final({})
    assert not (out / "final").exists()


# ---- item 5: one run per output_dir; workers die with their launcher ----------------------------------------
def test_second_writer_refused_naming_dir_and_pid(tiny, tmp_path):
    out = tmp_path / "out"
    held = OutputDirLock(out).acquire()
    try:
        with pytest.raises(TrainError, match=rf"output_dir {out} is in use by another training run "
                                             rf"\(pid {os.getpid()} on "):
            build_trainer(_cfg(tiny, out))
    finally:
        held.release()
    tr = build_trainer(_cfg(tiny, out))  # free again: the lock is taken and held by the run
    with pytest.raises(TrainError, match="in use"):
        OutputDirLock(out).acquire()
    tr.lock.release()


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for_lock(out: Path, seconds: float = 15.0) -> None:
    """Acquire the run's lock once its holders are gone; a loaded machine may take a moment to close a dead
    process's files. Fails naming every process that still has the lock file open."""
    deadline = time.time() + seconds
    while True:
        try:
            OutputDirLock(out).acquire().release()
            return
        except TrainError:
            if time.time() > deadline:
                lock = str(out / LOCK_NAME)
                holders = [fd.parts[2] for fd in Path("/proc").glob("[0-9]*/fd/*") if _points_to(fd, lock)]
                raise AssertionError(f"the lock is still held {seconds} s after the run died: {holders}") from None
            time.sleep(0.2)


def _points_to(fd: Path, target: str) -> bool:
    try:
        return os.readlink(fd) == target
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_two_process_run_owns_its_dir_and_dies_with_its_launcher(tiny, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1"}
    args = _args(tiny, out, "optim.max_steps=100000", "optim.epochs=100000", "save_interval=0")
    cmd = train_command(*args, processes=2, accelerate_config=str(ROOT / "configs/accelerate/cpu-ddp-2proc.yaml"))
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.time() + 180
        while not ((out / "log.jsonl").exists() and (out / "log.jsonl").read_text().count("\n") >= 2):
            assert launcher.poll() is None and time.time() < deadline, "the 2-process run did not start training"
            time.sleep(0.2)
        workers = _children(launcher.pid)
        assert len(workers) == 2, workers
        holder = json.loads((out / LOCK_NAME).read_text())["pid"]
        assert holder in workers
        second = subprocess.run(train_command(*_args(tiny, out)), cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=120, check=False)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"output_dir {out} is in use by another training run (pid {holder} on" in second.stderr
        assert second.stderr.count("error:") == 1
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.time() + 10
        while any(_alive(p) for p in workers) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in workers), "workers outlived their launcher"
        _wait_for_lock(out)  # the OS dropped the dead run's lock
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in workers:  # only if the test failed: the workers this test started
            if _alive(p):
                os.kill(p, signal.SIGKILL)
