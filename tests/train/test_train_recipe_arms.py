"""benchmarks/bench_recipes.py's arms are valid training configs that set what their names say (a mistyped
key would otherwise fail hours into a grid, or an arm would silently train today's recipe)."""
import importlib.util
import types
from pathlib import Path

import pytest

from eaglekit.train.config import load_train_config

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_recipes", ROOT / "benchmarks" / "bench_recipes.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
ARGS = types.SimpleNamespace(features="features", ttt=3, eval_samples=64, bf16=False, set=["head.draft_vocab_size=4096"],
                             arm_features=["fp8=features-fp8"])


@pytest.mark.parametrize("arm", list(bench.ARMS))
def test_train_recipe_arm_is_a_valid_config(arm):
    cfg = load_train_config(bench.CONFIG, [*bench.common(ARGS), *bench.ARMS[arm], *bench.arm_features(ARGS, arm)])
    base = load_train_config(bench.CONFIG, bench.common(ARGS))
    assert (cfg == base) == (arm == "base")  # every other arm changes the recipe (fp8: the features it reads)
    assert (cfg.data.features_dir == "features-fp8") == (arm == "fp8")
    want_lk = arm.startswith("lk")
    assert (cfg.loss.objective != "kl") == want_lk
    parallel = arm.startswith(("dflash", "dspark", "peagle"))
    eagle31 = "no_eagle31" not in arm and arm != "norm_before_fc" and not parallel
    assert cfg.head.kind == (arm.split("_")[0] if parallel else "eagle3")
    assert (cfg.loss.block_weighting == "dpace") == arm.endswith("dpace")
    assert cfg.head.train_embedding == arm.endswith("_embed")
    assert cfg.head.mask_embedding == (arm.endswith("_mask") or arm == "dflash_new")  # the published recipe's
    assert cfg.head.fc_norm == cfg.head.norm_output == eagle31
    assert cfg.head.norm_before_fc == (arm == "norm_before_fc")
    assert (cfg.loss.lk_acceptance == "greedy") == (arm == "lk_greedy")
    assert base.loss.objective == "kl" and base.head.fc_norm and base.head.norm_output  # today's recipe: kl, EAGLE 3.1
    assert cfg.head.draft_vocab_size == 4096  # --set reaches every arm


def test_train_recipe_fp8_arm_needs_its_features():
    with pytest.raises(SystemExit, match="--arm-features fp8=DIR"):
        bench.arm_features(types.SimpleNamespace(arm_features=[]), "fp8")


def test_train_recipe_default_grid():
    assert bench.GRID == ["base", "lk", "no_eagle31"] and set(bench.GRID) <= set(bench.ARMS)


def test_train_recipe_decode_tau_counts_tokens_per_verify_step():
    import torch
    from helpers import tiny_target

    from eaglekit.heads import HeadConfig, build_head

    target = tiny_target(vocab_size=64, hidden=32, layers=6)
    torch.manual_seed(0)
    head = build_head(HeadConfig.from_target(target, kind="eagle3", draft_vocab_size=64), target)
    prompts = [torch.randint(3, 64, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 7)]
    got = bench.decode_tau(target, head, prompts, depth=2, max_new_tokens=9)
    assert got["steps"] >= 2 * 3 and len(got["per_prompt"]) == 2  # >= 3 steps each: at most 3 tokens a step
    assert 1.0 <= got["tau"] <= 3.0


def test_train_recipe_decode_check_paired_ci():
    """bench_tau_check's paired comparison: a head accepting one more token on every prompt is ahead with a CI
    above 0 and wins every prompt; the same counts give a zero difference and no wins."""
    spec = importlib.util.spec_from_file_location("bench_tau_check", ROOT / "benchmarks" / "bench_tau_check.py")
    tau = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tau)
    steps = [10, 40, 25, 60, 15, 30, 50, 20]
    base = {"steps": steps, "accepted": [round(1.4 * s) for s in steps]}
    ahead = {"steps": steps, "accepted": [a + 3 for a in base["accepted"]]}
    got = tau.paired_ci(base, ahead, n_boot=2000)
    assert got["diff"] == pytest.approx(3 * len(steps) / sum(steps))
    assert 0 < got["ci95"][0] <= got["diff"] <= got["ci95"][1]
    assert (got["prompts_higher"], got["prompts_lower"]) == (len(steps), 0)
    same = tau.paired_ci(base, base, n_boot=200)
    assert same["diff"] == 0 and same["ci95"] == [0, 0] and same["prompts_higher"] == 0
