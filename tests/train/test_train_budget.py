"""``optim.max_minutes``: a wall-clock budget stops training early and still evaluates and saves the head."""
import json

from helpers import save_tiny, tiny_conversations

from eaglekit.heads import load_head
from eaglekit.target import load_target
from eaglekit.train.config import load_train_config
from eaglekit.train.trainer import train


def _cfg(tmp_path, *extra):
    return load_train_config(None, [
        f"target={tmp_path / 'tiny'}", f"data.conversations={tmp_path / 'convs.jsonl'}", "data.eval_samples=4",
        "head.kind=eagle3", "head.draft_vocab_size=32", "loss.ttt_steps=2", "data.batch_size=2", "optim.epochs=3",
        "progress=false", "trackers=[]", "eval_interval=0", "save_interval=0", f"output_dir={tmp_path / 'out'}",
        *extra])


def test_train_max_minutes_stops_early_and_saves_final(tmp_path):
    save_tiny(tmp_path / "tiny", vocab_size=64, hidden=32, layers=4)
    tiny_conversations(tmp_path / "convs.jsonl", n=24)
    final = train(_cfg(tmp_path, "optim.max_minutes=1e-6"))  # spent after the first step
    assert final["step"] == 1 < final["planned_steps"]
    assert 0.0 <= final["eval_tau_sim"] <= 3.0
    head = load_head(tmp_path / "out" / "final", load_target(tmp_path / "tiny"))
    assert head.config.draft_vocab_size == 32
    rows = [json.loads(line) for line in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert rows[-1]["final"] and rows[-1]["step"] == 1
