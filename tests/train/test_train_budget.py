"""``optim.max_minutes``: a wall-clock budget stops training early and still evaluates and saves the head."""
import itertools
import json
import math

import pytest
from helpers import save_tiny, tiny_conversations

from eaglekit.export import load_head
from eaglekit.target import load_target
from eaglekit.train.config import load_train_config
from eaglekit.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: one thread, see conftest


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


def test_lr_lambda_anneals_by_steps_or_budget_whichever_is_further():
    from eaglekit.train.build import lr_lambda

    spent = [0.0]
    f = lr_lambda(total=110, warmup=10, min_ratio=0.1, spent=lambda: spent[0])
    assert f(4) == pytest.approx(0.5)  # warmup ignores the clock
    assert f(60) == pytest.approx(0.55)  # half the steps, no time spent: cosine midpoint
    spent[0] = 0.75
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.75)))
    spent[0] = 3.0
    assert f(11) == pytest.approx(0.1)  # budget gone: the floor, never below it
    assert lr_lambda(110, 10, 0.1)(60) == pytest.approx(0.55)


class _FakeClock:
    """``time.perf_counter`` that advances a fixed amount per call: budgets without sleeping."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


def test_budget_stop_ends_annealed_and_a_resume_keeps_the_spent_time(tmp_path, monkeypatch):
    import eaglekit.timing as timing_mod

    save_tiny(tmp_path / "tiny", vocab_size=64, hidden=32, layers=4)
    tiny_conversations(tmp_path / "convs.jsonl", n=24)
    monkeypatch.setattr(timing_mod, "time", _FakeClock(0.5))  # the loop's Stopwatch, two readings a step: 1 s
    budget = ["optim.max_minutes=0.1", "optim.lr=1e-2", "optim.min_lr_ratio=0.2", "optim.warmup_steps=1"]
    final = train(_cfg(tmp_path, *budget, "optim.epochs=4"))
    rows = [json.loads(line) for line in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if "lr" in r]
    assert 4 <= final["step"] <= 8 < final["planned_steps"]  # ~6 s of a 6 s budget, long before the planned end
    assert lrs[-1] == pytest.approx(1e-2 * 0.2)  # annealed to the floor, not cut mid-schedule
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    # a run stopped by max_steps and resumed keeps its clock: ~4 s spent, ~2 s left of the budget
    out2 = f"output_dir={tmp_path / 'out2'}"
    train(_cfg(tmp_path, *budget, "optim.epochs=4", "optim.max_steps=4", "save_interval=2", out2))
    again = train(_cfg(tmp_path, *budget, "optim.epochs=4", "optim.max_steps=40", "save_interval=2", out2,
                       "resume_allow_changes=true"))  # max_steps differs from the checkpoint's config
    assert 4 < again["step"] <= final["step"] + 1  # a fresh clock would run ~final["step"] more steps
