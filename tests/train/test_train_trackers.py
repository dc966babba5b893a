"""The default tracker: a run with ``trackers=[tensorboard]`` writes TensorBoard event files under its
output dir holding the same scalars as log.jsonl (training loss every step, held-out τ_sim)."""
import json

import pytest
from helpers import save_tiny, tiny_conversations
from tensorboard.backend.event_processing import event_accumulator  # a dependency (pyproject.toml): no skip

from eaglekit.train.config import TrainConfig, load_train_config
from eaglekit.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: one thread, see conftest


def test_train_default_tracker_is_tensorboard():
    assert TrainConfig().trackers == ["tensorboard"]


def test_train_tensorboard_events_hold_logged_scalars(tmp_path):
    save_tiny(tmp_path / "tiny", vocab_size=64, hidden=32, layers=4)
    tiny_conversations(tmp_path / "convs.jsonl", n=16)
    out = tmp_path / "out"
    cfg = load_train_config(None, [
        f"target={tmp_path / 'tiny'}", f"data.conversations={tmp_path / 'convs.jsonl'}", "data.eval_samples=4",
        "head.kind=eagle3", "head.draft_vocab_size=32", "loss.ttt_steps=2", "data.batch_size=2",
        "optim.max_steps=4", "eval_interval=2", "save_interval=0", "progress=false", "trackers=[tensorboard]",
        f"output_dir={out}"])
    final = train(cfg)

    run_dir = out / "eaglekit"  # Accelerate: project_dir / the init_trackers name (hparams go to a sub-run)
    assert list(run_dir.glob("events.out.tfevents.*")), f"no TensorBoard event file in {run_dir}"
    acc = event_accumulator.EventAccumulator(str(run_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr", "acc_0", "eval_tau_sim", "eval_acc_0"} <= tags, sorted(tags)

    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    logged = {e.step: e.value for e in acc.Scalars("loss")}
    assert sorted(logged) == sorted(losses) == [1, 2, 3, 4]
    assert all(logged[s] == pytest.approx(losses[s], rel=1e-6) for s in losses)  # float32 in the event file
    tau = [e.value for e in acc.Scalars("eval_tau_sim")]
    assert len(tau) == 2 and tau[-1] == pytest.approx(final["eval_tau_sim"], rel=1e-6)  # step-2 eval + final
