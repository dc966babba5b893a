"""`eaglekit bench` per-prompt records, speedup per category, acceptance per depth and their PNGs
(tiny saved models, seconds)."""
import importlib.util
import json
import math
import statistics

import pytest
import torch
from helpers import save_tiny

from eaglekit import assets
from eaglekit.bench.report import table
from eaglekit.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None  # optional: the 'bench' extra


def assert_png(path):
    """A PNG where matplotlib is installed; without it, none (the documented fallback: a note, no file)."""
    if HAVE_MATPLOTLIB:
        assert path.read_bytes()[:8] == PNG_MAGIC, path
    else:
        assert not path.exists(), path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from test_decode_core import tiny_head

    from eaglekit.target import load_target

    root = tmp_path_factory.mktemp("bench_plots")
    target_dir = save_tiny(root / "target", layers=3, max_position_embeddings=4096)
    tiny_head(load_target(str(target_dir)), "eagle3", 48).save_pretrained(root / "head")
    return target_dir, root / "head"


def bench(tmp_path, *overrides):
    assert main(["bench", "hf_baselines=false", "max_new_tokens=8", f"out={tmp_path}", *overrides]) == 0
    (path,) = tmp_path.glob("*.json")
    return path, json.loads(path.read_text())


def first_of_each_category(n):
    return list(dict.fromkeys(q["category"] for q in assets.load_mt_bench()))[:n]


def target_chat_lengths(target_dir, categories):
    """Prompt lengths of the first question of each of ``categories`` (the bench's spread order)."""
    from eaglekit.target import load_target

    target = load_target(str(target_dir))
    firsts = {c: next(q["turns"][0] for q in assets.load_mt_bench() if q["category"] == c) for c in categories}
    return [target.chat_ids(firsts[c]).shape[1] for c in categories]


def ours_cell(r):
    return f"{r['decode_speedup_vs_plain']:.2f}x, {r['expected_speedup']:.2f}x"


def test_decode_bench_plots_target_as_its_own_draft(saved, tmp_path):
    """The target drafting for itself is accepted at every depth, greedy and sampled (p = q)."""
    target_dir, _ = saved
    path, rep = bench(tmp_path, f"target={target_dir}", f"draft={target_dir}", "prompts=3", "prompt_order=spread",
                      "repeats=2", "gamma=3", "temperatures=[0.0, 1.0]")
    assert set(rep["results"]["0.0"]) == {"plain", "ours"}  # the existing keys are unchanged
    cats = first_of_each_category(3)
    assert len(set(cats)) == 3
    for temp in ("0.0", "1.0"):
        records = rep["per_prompt"][temp]
        # an eos that stops a step early counts as a rejection in DecodeStats: these seeds have none
        assert all(n == 8 for r in records for n in r["ours"]["tokens"]), records
        assert rep["acceptance_per_depth"][temp] == [1.0, 1.0, 1.0]
        assert [r["category"] for r in records] == cats
        assert all(r["ours"]["acceptance_per_depth"] == [1.0, 1.0, 1.0] for r in records)
        for r in records:
            assert len(r["plain"]["seconds"]) == len(r["ours"]["tokens"]) == 2
        assert list(rep["speedup_per_category"][temp]) == cats
        for cat, speedup in rep["speedup_per_category"][temp].items():  # recomputed from the records
            (r,) = [r for r in records if r["category"] == cat]
            ratios = [(r["ours"]["tokens"][k] / r["ours"]["seconds"][k]) /
                      (r["plain"]["tokens"][k] / r["plain"]["seconds"][k]) for k in range(2)]
            assert speedup == pytest.approx(statistics.median(ratios))
    assert rep["per_prompt"]["0.0"][0]["ours"]["tokens"] == rep["per_prompt"]["0.0"][0]["plain"]["tokens"]
    for temp in ("0.0", "1.0"):  # what the measured acceptance and step costs predict, beside the measured
        plain, ours = rep["results"][temp]["plain"], rep["results"][temp]["ours"]
        # every prompt: a step accepting all 3 drafted tokens, then one with room for 2 of 3 (8 new tokens)
        assert ours["step_rates"] == [1.0, 1.0, 0.5] and ours["alpha"] == 1.0
        step = ours["draft_s_per_forward"] + ours["verify_s_per_forward"]
        assert ours["expected_speedup"] == pytest.approx(3.5 * plain["verify_s_per_forward"] / step)
        c = ours["cost_ratio_c"]
        assert c == pytest.approx(ours["draft_s_per_forward"] / 3 / plain["verify_s_per_forward"])
        assert ours["expected_speedup_leviathan"] == pytest.approx(4 / (3 * c + 1))
        assert plain["step_rates"] == [] and plain["expected_speedup"] == pytest.approx(  # its drafter: a no-op
            plain["verify_s_per_forward"] / (plain["draft_s_per_forward"] + plain["verify_s_per_forward"]))
        assert plain["decode_speedup_vs_plain"] == 1.0 and ours["decode_speedup_vs_plain"] > 0
    mem = rep["memory"]
    longest = max(target_chat_lengths(target_dir, cats)) + 8
    assert mem["drafter"]["parameters"] == mem["target"]["parameters"] > 0  # the target drafting for itself
    assert mem["drafter"]["context_tokens"] == longest
    assert mem["target"]["kv_bytes_at_context"] == 2 * 3 * 2 * 8 * 4 * longest  # 3 layers, 2 KV heads of 8, fp32
    assert rep["load_average"] is None or len(rep["load_average"]) == 3
    lines = table(rep).splitlines()
    (row,) = [line for line in lines if line.startswith("| 0.0 | ours |")]
    assert f"| {ours_cell(rep['results']['0.0']['ours'])} (Leviathan " in row
    assert any(line.startswith("drafter: ") and "MiB at" in line for line in lines)
    for suffix in ("", "-acceptance", "-categories"):
        assert_png(path.with_name(f"{path.stem}{suffix}.png"))


def test_decode_bench_plots_head_acceptance_pools_generate_stats(saved, tmp_path):
    """A random head: the report's acceptance per depth is DecodeStats' rate over all prompts' steps pooled."""
    from eaglekit.bench.prompts import load_prompts
    from eaglekit.decode import DecodeStats, generate
    from eaglekit.decode.cli import parse_tree
    from eaglekit.export import load_head
    from eaglekit.target import load_target

    target_dir, head_dir = saved
    _, rep = bench(tmp_path, f"target={target_dir}", f"head={head_dir}", "prompts=2", "repeats=1",
                   "tree=3,2,6", "temperatures=[0.0]")
    target = load_target(str(target_dir))
    head = load_head(str(head_dir), target)
    pooled, per_prompt = DecodeStats(), []
    for i, ids in enumerate(load_prompts(target, "mt-bench", 2)):
        stats = generate(target, head, ids, 8, temperature=0.0, seed=i, tree=parse_tree("3,2,6")).stats
        pooled.accept_lengths += stats.accept_lengths
        pooled.path_lengths += stats.path_lengths
        pooled.tree_depths += stats.tree_depths
        per_prompt.append([None if math.isnan(r) else r for r in stats.acceptance_per_depth])
    expected = [None if math.isnan(r) else r for r in pooled.acceptance_per_depth]
    assert len(expected) >= 2  # the tree reached depth 2 at least once
    assert rep["acceptance_per_depth"]["0.0"] == expected  # ratios of counts: exact through JSON
    assert [r["ours"]["acceptance_per_depth"] for r in rep["per_prompt"]["0.0"]] == per_prompt
    assert all(r is None or 0.0 <= r <= 1.0 for r in expected)
    assert list(rep["speedup_per_category"]["0.0"]) == ["writing"]  # the first two questions
    head_mem, target_mem = rep["memory"]["drafter"], rep["memory"]["target"]
    assert head_mem["kind"] == "eagle3" and 0 < head_mem["parameters"] < target_mem["parameters"]
    assert head_mem["kv_bytes_per_token"] < target_mem["kv_bytes_per_token"]  # one layer beside the target's 3
    ours = rep["results"]["0.0"]["ours"]
    assert ours["expected_speedup"] == pytest.approx(
        (1 + sum(math.prod(ours["step_rates"][:d + 1]) for d in range(len(ours["step_rates"]))))
        * rep["results"]["0.0"]["plain"]["verify_s_per_forward"]
        / (ours["draft_s_per_forward"] + ours["verify_s_per_forward"]))
    assert "expected_speedup_leviathan" not in ours  # a tree, not a chain
    assert torch.isfinite(torch.tensor(rep["speedup_per_category"]["0.0"]["writing"]))


def test_decode_bench_plots_only_with_a_drafter(saved, tmp_path):
    target_dir, _ = saved
    path, rep = bench(tmp_path, f"target={target_dir}", "prompts=1", "repeats=1", "temperatures=[0.0]")
    assert "acceptance_per_depth" not in rep and "speedup_per_category" not in rep
    assert set(rep["per_prompt"]["0.0"][0]) == {"category", "plain"}
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ([f"{path.stem}.png"] if HAVE_MATPLOTLIB else [])
    from eaglekit.bench.prompts import load_questions

    assert [c for c, _ in load_questions("humaneval", 2)] == ["humaneval", "humaneval"]
    with pytest.raises(ValueError, match="prompt_order"):
        load_questions("mt-bench", 2, "random")


def test_decode_bench_plots_without_matplotlib_write_the_json_and_say_so(saved, tmp_path, monkeypatch, capsys):
    """matplotlib is optional: hidden from the import system, the bench still writes its JSON, no PNG, and
    says once per plot how to get them."""
    import sys

    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib` now raises ImportError
    target_dir, head_dir = saved
    _, rep = bench(tmp_path, f"target={target_dir}", f"head={head_dir}", "prompts=1", "repeats=1",
                      "tree=2,2,3", "temperatures=[0.0]")
    assert rep["results"]["0.0"]["ours"]["tokens_per_s"] > 0 and not list(tmp_path.glob("*.png"))
    notes = [line for line in capsys.readouterr().out.splitlines() if "matplotlib not installed" in line]
    assert len(notes) == 3 and "eaglekit[bench]" in notes[0]  # speedup, acceptance, categories
