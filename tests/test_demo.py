"""`eaglekit demo`'s decode phase: one MT-bench question per category, a compact table, every output
compared with plain decoding; its training launch passes what accelerate would otherwise warn about.
Tiny random models, seconds."""
import pytest
import torch
from helpers import tiny_target

from eaglekit import assets, demo
from eaglekit.decode import TreeSpec
from eaglekit.decode.cost import Plan
from eaglekit.heads import HeadConfig, build_head

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest


def mt_bench_categories():
    return list(dict.fromkeys(q["category"] for q in assets.load_mt_bench()))


def test_demo_questions_one_per_category():
    cats = mt_bench_categories()
    assert len(cats) == 8
    picked = demo.demo_questions(8)
    assert [c for c, _ in picked] == cats  # not the first 8 questions, which are all "writing"
    firsts = {c: next(q["turns"][0] for q in assets.load_mt_bench() if q["category"] == c) for c in cats}
    assert all(text == firsts[c] for c, text in picked)


def test_demo_decode_side_by_side_table():
    target = tiny_target(layers=3, max_position_embeddings=4096)
    torch.manual_seed(0)
    head = build_head(HeadConfig.from_target(target, kind="eagle3", aux_layer_ids=[0, 1, 2]), target)
    questions = demo.demo_questions(2)
    result = demo.decode_side_by_side(target, head, questions, max_new_tokens=6, tree=TreeSpec(2, 2, 4),
                                      lookup=(2, 5, 10), repeats=2)
    assert [r["category"] for r in result["rows"]] == [c for c, _ in questions]
    assert all(r["identical"] and r["identical_lookup"] for r in result["rows"])
    assert result["all_identical"] and result["questions"] == 2
    table = demo.results_table(result, width=20).splitlines()
    assert len(table) == 4  # header, 2 questions, totals
    assert table[0].split()[:3] == ["question", "category", "τ"] and "identical" in table[0]
    assert table[1].startswith(questions[0][1][:19] + "…") and " yes" in table[1]
    assert table[-1].startswith("all 2") and table[-1].endswith("2/2")
    assert f"{result['speedup']:.2f}x" in table[-1] and f"{result['tau_mean_lookup']:.2f}" in table[-1]
    assert all(len(r["seconds"][m]) == 2 for r in result["rows"] for m in ("plain", "eagle", "lookup"))


def test_demo_results_table_marks_a_differing_output():
    row = {"question": "q", "category": "math", "tau": 1.5, "speedup": 2.0, "identical": True}
    result = {"questions": 2, "tau_mean": 1.5, "speedup": 2.0,
              "rows": [row, {**row, "category": "coding", "identical": False}]}
    lines = demo.results_table(result).splitlines()
    assert lines[1].endswith("yes") and lines[2].endswith("NO") and lines[-1].endswith("1/2")
    assert "2.00x" in lines[1] and "+lookup" not in lines[0]
    busy = demo.results_table({**result, "machine_note": "machine too busy for timings (load 1.0)"})
    assert busy.splitlines()[-1] == "machine too busy for timings (load 1.0)"


def test_demo_times_methods_as_the_bench_does(monkeypatch):
    """Each question's methods run ``repeats`` times in the bench's balanced order (plain not always first),
    and a speedup is the median over repeats of paired ratios: one slow repeat of plain (another process
    woke up) moves a ratio of totals or of means, not the median."""
    from eaglekit.bench import methods
    from eaglekit.decode.stats import DecodeStats

    order, seconds = [], {"plain": iter([1.0, 1.0, 9.0] * 2), "eagle": iter([0.5] * 6)}

    def fake(name):
        def fn(ids):
            order.append(name)
            return 3, DecodeStats(accept_lengths=[2, 1], new_tokens=3), ids
        return fn

    def timed(fn):
        out = fn()
        return out, next(seconds[order[-1]])

    monkeypatch.setattr(methods, "timed", timed)
    monkeypatch.setattr(demo, "decode_methods", lambda *a: {"plain": fake("plain"), "eagle": fake("eagle")})
    target = tiny_target()
    result = demo.decode_side_by_side(target, None, demo.demo_questions(2), 4, tree=None, repeats=3)
    runs = [order[i:i + 2] for i in range(0, len(order), 2)]
    assert len(runs) == 6 and {r[0] for r in runs} == {"plain", "eagle"}  # each method leads some runs
    for r in result["rows"]:
        assert r["speedup"] == 2.0 and r["identical"] and r["tau"] == 1.5  # ratios 2, 2, 18: median 2
    # totals per repeat: plain 2 / 2 / 18 s (either question's order) vs eagle 1 s each: median 2
    assert result["speedup"] == 2.0 and result["repeats"] == 3


def test_demo_says_when_the_machine_is_too_busy_for_timings():
    assert demo.busy_note(0.1, 2, [2.3, 1.0, 1.0], threads=2) is None  # the demo's own 2 threads
    note = demo.busy_note(1.0, 2, [1.2, 1.0, 1.0], threads=1)  # one other process spinning
    assert note.startswith("machine too busy for timings (load 1.0 on 2 CPUs") and "not meaningful" in note
    assert "load 2.5" in demo.busy_note(0.0, 2, [4.5, 1.0, 1.0], threads=2)  # it came during the decoding
    assert demo.busy_note(None, 2, None, threads=2) is None  # nothing measurable: no claim either way


def test_demo_train_launch_passes_accelerate_defaults(monkeypatch, tmp_path):
    """accelerate prints a 'values were not passed' block for every one of these left to its defaults."""
    seen = []
    monkeypatch.setattr(demo, "_run", lambda cmd, threads=None: seen.append((cmd, threads)))
    demo.train(tmp_path, tmp_path / "data", "cfg.yaml", 1, threads=1)
    ((cmd, threads),) = seen
    assert threads == 1 and cmd[cmd.index("--num_cpu_threads_per_process") + 1] == "1"  # chosen from free CPUs
    launch = cmd[:cmd.index(str(demo.ROOT / "train_head.py"))]
    for flag in ("--num_processes", "--num_machines", "--num_cpu_threads_per_process", "--mixed_precision",
                 "--dynamo_backend"):
        assert flag in launch and not launch[launch.index(flag) + 1].startswith("--"), flag


def test_demo_train_skipped_once_the_head_is_trained(monkeypatch, tmp_path):
    """A rerun does not train the last steps again from the last checkpoint once the run has finished."""
    seen = []
    monkeypatch.setattr(demo, "_run", lambda cmd, threads=None: seen.append(cmd))
    final = tmp_path / "head" / "final"
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"x")
    assert demo.train(tmp_path, tmp_path / "data", "cfg.yaml", 1) == final and len(seen) == 1  # not finished
    (tmp_path / "head" / "metrics.json").write_text("{}")  # written after final/
    assert demo.train(tmp_path, tmp_path / "data", "cfg.yaml", 1) == final and len(seen) == 1


def test_demo_failed_step_is_one_error_line(capsys):
    """A step that fails stops the demo with one line naming how (not as an unexpected error)."""
    import sys

    from eaglekit.cli import error_line

    with pytest.raises(demo.StepFailed, match="exit status 3") as e:
        demo._run([sys.executable, "-c", "raise SystemExit(3)"])
    assert error_line(e.value).startswith("eaglekit: error: the command above failed (exit status 3)")


def test_demo_planner_line_says_the_choice_and_why_in_words():
    pays = demo.planner_line(Plan(TreeSpec(depth=5, top_k=8, total_tokens=48), 14.7, 14.6))
    assert pays.startswith("planner: drafting with a tree of up to 48 tokens, 5 deep, the top 8 at each level")
    assert "14.7 tokens/s expected with it against 14.6 with plain decoding" in pays and "measured" in pays
    loses = demo.planner_line(Plan(TreeSpec(depth=3, top_k=2, total_tokens=6), 9.1, 14.6))
    assert loses.startswith("planner: drafting would not pay here (9.1 tokens/s expected with the best tree "
                            "against 14.6 with plain decoding")
    assert "the demo drafts anyway, with a tree of up to 6 tokens, 3 deep" in loses
    assert not any("TreeSpec(" in line or "tree='auto'" in line for line in (pays, loses))  # no code repr
