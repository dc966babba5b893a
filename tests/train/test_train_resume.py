"""kill -9 in the middle of training, then ``resume=auto``: the same loss curve and final head as an
uninterrupted run (full state: head, optimizer, scheduler, data position, RNG — EAGLE-1 feature noise
draws from the RNG, so a lost RNG state would change the curve)."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import save_tiny, tiny_conversations, train_command
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


def _args(d: Path, out: Path, *extra):
    return [f"target={d / 'tiny'}", f"data.conversations={d / 'convs.jsonl'}", "data.eval_samples=8",
            "head.kind=eagle1", "loss.ttt_steps=2", "loss.noise=0.2", f"output_dir={out}", "optim.epochs=4",
            "optim.lr=1e-3", "data.batch_size=2", "progress=false", "trackers=[]", "eval_interval=0",
            "save_interval=4", "keep_last=2", *extra]


def _curve(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "final" not in r}  # a step rerun after resume overwrites


@pytest.mark.slow
def test_train_kill9_then_resume_auto_matches_uninterrupted(tmp_path):
    save_tiny(tmp_path / "tiny", vocab_size=64, hidden=32, layers=6)
    tiny_conversations(tmp_path / "convs.jsonl", n=40)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    r = subprocess.run(train_command(*_args(tmp_path, ref, "resume=none")), cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    total = max(_curve(ref))
    assert total >= 40

    proc = subprocess.Popen(train_command(*_args(tmp_path, cut)), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not (cut / "checkpoints/step-24").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    killed_at = max(_curve(cut))
    assert killed_at < total and not (cut / "final").exists()

    r = subprocess.run(train_command(*_args(tmp_path, cut, "resume=auto")), cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout + r.stderr
    assert _curve(cut) == _curve(ref)  # every step's loss, bit for bit
    a, b = load_file(str(ref / "final/model.safetensors")), load_file(str(cut / "final/model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]).all(), k
    kept = sorted(p.name for p in (cut / "checkpoints").iterdir())
    assert len([k for k in kept if k.startswith("step-")]) == 2 and not [k for k in kept if k.startswith(".tmp")]


def test_a_checkpoint_config_is_compared_in_todays_shape(tmp_path):
    """A stored ``target: NAME`` (the section's shorthand) and a field added since (at its default) are no
    change; a real change is reported under its dotted key; a stored config that no longer loads (a flat
    ``target_dtype``, a key eaglekit never reads) is compared as stored, so its key shows as a change."""
    from eaglekit.config import to_dict
    from eaglekit.train.checkpoint_files import config_changes
    from eaglekit.train.checkpoint_trainer import stored_config
    from eaglekit.train.config import load_train_config

    cfg = load_train_config(None, ["data.conversations=x", "target=some/model"])
    old = {k: v for k, v in to_dict(cfg).items() if k not in ("target", "eval_only")}

    def changes(stored: dict) -> list:
        (tmp_path / "train_config.json").write_text(json.dumps(stored))
        return config_changes(stored_config(tmp_path), to_dict(cfg))

    assert changes({**old, "target": "some/model"}) == []
    assert changes({**old, "target": {"name": "some/model", "dtype": "bfloat16"}}) == [
        ("target.dtype", "bfloat16", "float32")]
    assert ("target_dtype", "float32", None) in changes({**old, "target": "some/model", "target_dtype": "float32"})
