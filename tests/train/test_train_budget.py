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


def test_train_init_from_a_saved_head_and_eval_only(tmp_path):
    """``head.init_from`` starts from a saved head (weights and draft vocab); ``eval_only`` scores it unchanged."""
    import pytest
    import torch

    save_tiny(tmp_path / "tiny", vocab_size=64, hidden=32, layers=4)
    tiny_conversations(tmp_path / "convs.jsonl", n=24)
    first = train(_cfg(tmp_path, "optim.epochs=2", "optim.lr=3e-3"))
    saved = tmp_path / "out" / "final"
    ev = train(_cfg(tmp_path, f"head.init_from={saved}", "eval_only=true", f"output_dir={tmp_path / 'ev'}"))
    assert ev["step"] == 0 and ev["eval_tau_sim"] == pytest.approx(first["eval_tau_sim"], rel=1e-6)
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text())["eval_of"] == str(saved)
    assert not (tmp_path / "ev" / "final").exists()
    fresh = train(_cfg(tmp_path, "eval_only=false", "optim.max_steps=0", "optim.epochs=1", "optim.lr=0",
                       f"output_dir={tmp_path / 'fresh'}"))
    assert fresh["eval_tau_sim"] != pytest.approx(first["eval_tau_sim"], rel=1e-6)  # the start matters
    tiny = load_target(tmp_path / "tiny")
    a, b = load_head(saved, tiny), load_head(tmp_path / "fresh" / "final", tiny)
    assert not torch.equal(a.fc.weight, b.fc.weight)
    with pytest.raises(ValueError, match="init_from.*num_layers"):
        train(_cfg(tmp_path, f"head.init_from={saved}", "head.num_layers=2", f"output_dir={tmp_path / 'bad'}"))
