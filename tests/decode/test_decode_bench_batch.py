"""`eaglekit bench batch_sizes=[...]` on tiny saved models (seconds): per batch size, every method's tokens,
τ, speedup and expected speedup, the memory block and the PNG; and the formulas of bench.theory."""
import json

import pytest
from test_decode_bench_plots import assert_png, saved  # noqa: F401 (the fixture)

from eaglekit.bench import theory
from eaglekit.cli import main
from eaglekit.decode.stats import DecodeStats

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest


def batch_bench(tmp_path, *overrides, sizes="[1,2,4]"):
    assert main(["bench", "max_new_tokens=8", "prompts=4", "repeats=1", "temperatures=[0.0]", f"out={tmp_path}",
                 f"batch_sizes={sizes}", *overrides]) == 0
    (path,) = tmp_path.glob("*-batch.json")
    return path, json.loads(path.read_text())


def test_decode_bench_batch_self_draft_every_size(saved, tmp_path):  # noqa: F811
    """The target drafting for itself: at every batch size every draft is accepted (τ = γ + 1 but for the
    last step, α = 1), the same tokens as plain, and Leviathan's formula with α = 1 is (γ+1)/(γc+1)."""
    target_dir, _ = saved
    path, rep = batch_bench(tmp_path, f"target={target_dir}", f"draft={target_dir}", "gamma=3", "lookup_tokens=3")
    per_b = rep["results"]["0.0"]
    assert list(per_b) == ["1", "2", "4"] and rep["mode"] == "batch"
    for b, res in per_b.items():
        assert set(res) == {"plain", "ours", "lookup"}, b
        plain, ours = res["plain"], res["ours"]
        assert plain["repeats"][0]["tokens"] == ours["repeats"][0]["tokens"] == 4 * 8  # no EOS in 8 tokens here
        assert ours["acceptance_per_depth"] == [1.0, 1.0, 1.0] and ours["alpha"] == 1.0
        assert [res[m]["repeats"][0]["identical_to_plain"] for m in res] == ["4/4"] * 3
        assert ours["tau"] > 3, (b, ours["tau"])
        c = ours["cost_ratio_c"]
        assert ours["expected_speedup_leviathan"] == pytest.approx(4 / (3 * c + 1))
        # each row: a step accepting all 3 drafted tokens, then one with room for 2 (8 tokens): 3.5 per step
        assert ours["step_rates"] == [1.0, 1.0, 0.5]
        # the batch's own τ: every row ends at the same step, so B × 3.5 tokens per batched forward (plain: B)
        assert ours["tokens_per_forward"] == 3.5 * int(b) and plain["tokens_per_forward"] == int(b)
        assert ours["expected_speedup"] == pytest.approx(3.5 * plain["verify_s_per_forward"] /
                                                         (ours["draft_s_per_forward"] + ours["verify_s_per_forward"]))
        assert plain["speedup_vs_plain"] == plain["decode_speedup_vs_plain"] == 1.0 and plain["tau"] == 1.0
        rep0 = ours["repeats"][0]
        # the prefill (and its token) left out: another rate than the whole run's (which is larger depends on
        # how the prefill's time compares with a step's, a timing this test does not assert on)
        assert rep0["decode_tokens_per_s"] > 0 and rep0["decode_tokens_per_s"] != rep0["tokens_per_s"]
    mem = rep["memory"]
    assert mem["drafter"]["parameters"] == mem["target"]["parameters"] > 0
    assert mem["target"]["kv_bytes_per_token"] == 2 * 3 * 2 * 8 * 4  # 3 layers, 2 KV heads of 8, fp32
    assert_png(path.with_suffix(".png"))


def test_decode_bench_batch_head_auto_plans_per_size(saved, tmp_path):  # noqa: F811
    """A head: "ours" drafts at every size, "auto" is planned per size (a plan recorded for each)."""
    target_dir, head_dir = saved
    _, rep = batch_bench(tmp_path, f"target={target_dir}", f"head={head_dir}", sizes="[1,2]")
    assert set(rep["auto_plans"]) == {"1", "2"}
    for res in rep["results"]["0.0"].values():
        assert set(res) == {"plain", "ours", "auto"}
        assert res["ours"]["repeats"][0]["tokens"] == res["plain"]["repeats"][0]["tokens"]
        assert "expected_speedup_leviathan" not in res["ours"]  # a tree, not a chain
    head = rep["memory"]["drafter"]
    assert head["kind"] == "eagle3" and 0 < head["parameters"] < rep["memory"]["target"]["parameters"]


def test_decode_bench_batch_theory_formulas():
    assert theory.leviathan_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.2))
    assert theory.leviathan_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)
    assert theory.leviathan_speedup(1.0, 4, 0.0) == 5.0
    assert theory.expected_tokens([0.5, 0.5, None, 0.9]) == 1.75
    assert theory.tree_speedup([0.5], 0.01, 0.05, 0.04) == pytest.approx(1.5 * 0.04 / 0.06)
    # steps accepting 0 of 2, 2 of 3, 3 of 3 and 0 of 1 drafted depths: a rejection is a tried depth too
    s = DecodeStats(path_lengths=[1, 3, 4, 1], tree_depths=[2, 3, 3, 1])
    assert theory.pooled_alpha(s) == pytest.approx((0 + 2 + 3 + 0) / (1 + 3 + 3 + 1))
    assert theory.pooled_alpha(DecodeStats(path_lengths=[1], tree_depths=[0])) is None
    # a tree that stops short counts as a miss at the depths it lacks: E[tokens] is the mean accepted path
    assert theory.step_rates(s) == [0.5, 1.0, 0.5]
    assert theory.expected_tokens(theory.step_rates(s)) == pytest.approx((1 + 3 + 4 + 1) / 4)


def test_decode_bench_batch_speedup_is_paired_by_repeat():
    """Within a repeat every method ran group by group beside plain: the speedup is the median of the
    per-repeat ratios (and their range), not a ratio of medians taken from different repeats."""
    from eaglekit.bench.batch import summarise_batch

    def rep(tps):
        return {"tokens_per_s": tps, "decode_tokens_per_s": tps, "tau": None, "draft_s_per_forward": 0.0,
                "verify_s_per_forward": 1 / tps, "identical_to_plain": None, "tokens_per_forward": 1.0}

    runs = {"plain": [rep(100.0), rep(50.0), rep(80.0)], "auto": [rep(90.0), rep(60.0), rep(60.0)]}
    out = summarise_batch(runs, {n: DecodeStats() for n in runs}, gamma=4, drafted_by_chain=False)
    # per repeat 0.9, 1.2, 0.75: median 0.9 (a ratio of medians would say 60 / 80 = 0.75)
    assert out["auto"]["decode_speedup_vs_plain"] == pytest.approx(0.9)
    assert out["auto"]["speedup_vs_plain"] == pytest.approx(0.9)
    assert out["auto"]["decode_speedup_range"] == pytest.approx([0.75, 1.2])
    assert out["plain"]["decode_speedup_vs_plain"] == 1.0


def test_decode_bench_batch_method_order_is_balanced():
    """Over n group runs (2n for an odd n) every method runs first once and right after every other one
    once: no method always follows the same one."""
    from eaglekit.bench.methods import method_order

    for names in (["plain", "ours", "auto", "lookup"], ["plain", "ours", "auto"], ["plain", "ours"]):
        n = len(names)
        runs = n if n % 2 == 0 else 2 * n
        orders = [method_order(names, k) for k in range(runs)]
        assert all(sorted(o) == sorted(names) for o in orders)
        assert sorted(o[0] for o in orders) == sorted(names * (runs // n))
        pairs = [(o[j], o[j + 1]) for o in orders for j in range(n - 1)]
        every = [(a, b) for a in names for b in names if a != b]
        assert sorted(pairs) == sorted(every * (1 if n % 2 == 0 else 2)), (names, orders)


def test_decode_bench_one_prompt_method_order_is_balanced():
    """The one-prompt bench runs its methods in the balanced order too (plain not always first), and still
    counts a method's output against plain's of the same prompt, whichever ran first."""
    import torch

    from eaglekit.bench.cli import BenchConfig, bench_temperature
    from eaglekit.decode.stats import DecodeStats

    calls = []

    def fake(name, differs_on=None):
        def fn(ids, temp, seed):
            calls.append(name)
            seq = ids.clone()
            if differs_on is not None and int(ids[0, 0]) == differs_on:
                seq[0, -1] += 1
            return int(seq.shape[1]), DecodeStats(), seq
        return fn

    fns = {"plain": fake("plain"), "ours": fake("ours", differs_on=2), "lookup": fake("lookup")}
    prompts = [torch.tensor([[p, 5, 6]]) for p in range(4)]
    runs, _, _ = bench_temperature(BenchConfig(repeats=2), fns, prompts, ["writing"] * 4, 0.0)
    orders = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert len(orders) == 8 and all(sorted(o) == sorted(fns) for o in orders)
    assert {o[0] for o in orders} == set(fns)  # each method leads some prompts
    assert [r["identical_to_plain"] for r in runs["ours"]] == ["3/4", "3/4"]
    assert [r["identical_to_plain"] for r in runs["lookup"]] == ["4/4", "4/4"]
