"""The training progress bar shows measured figures only: the step's loss and accuracy from the first
step, the held-out tau_sim once an evaluation has measured it — never a nan placeholder before that."""
import re

import pytest
from helpers import save_tiny, tiny_conversations

from eaglekit.train.config import load_train_config
from eaglekit.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: one thread, see conftest


def test_train_progress_bar_shows_tau_sim_only_once_measured(tmp_path, capsys):
    save_tiny(tmp_path / "tiny", vocab_size=64, hidden=32, layers=4)
    tiny_conversations(tmp_path / "convs.jsonl", n=16)
    cfg = load_train_config(None, [
        f"target={tmp_path / 'tiny'}", f"data.conversations={tmp_path / 'convs.jsonl'}", "data.eval_samples=4",
        "head.kind=eagle3", "head.draft_vocab_size=32", "loss.ttt_steps=2", "data.batch_size=2",
        "optim.max_steps=3", "eval_interval=2", "save_interval=0", "progress=true", "trackers=[]",
        f"output_dir={tmp_path / 'out'}"])
    train(cfg)
    bar = capsys.readouterr().err
    frames = [f for f in re.split(r"[\r\n]", bar) if f.startswith("train:") and "loss=" in f]
    step = {int(m.group(1)): f for f in frames if (m := re.search(r"\| (\d)/3 ", f))}
    assert sorted(step) == [1, 2, 3], bar
    assert not any(re.search(r"=nan\b", f) for f in frames), bar
    assert "acc0=" in step[1] and "tau_sim" not in step[1]  # no evaluation yet: nothing to show
    assert "tau_sim=" in step[2] and "tau_sim=" in step[3]  # measured by the step-2 evaluation
