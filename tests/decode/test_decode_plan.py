"""tree="auto": the same chooser picks a small tree when verification cost grows with the tree (CPU)
and a large one when it is nearly flat (GPU); measuring, calibrating and caching work on a tiny model."""
import warnings

import pytest
import torch
from helpers import tiny_target

from eaglekit import decode
from eaglekit.decode import api, cost
from eaglekit.decode.drafters import TreeSpec

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest


def synthetic_pools(accept=0.7, contexts=2, untrained=False):
    """A confident head: the best child has probability `accept`, the next ones share the rest;
    an untrained one spreads its mass over a 32k vocabulary."""
    pools = {}
    for k in cost.LEVEL_SIZES:
        child = [accept] + [(1 - accept) / 2 ** (i + 1) for i in range(k - 1)]
        child = [1 / 32000] * k if untrained else child
        depths, probs, frontier = [], [], [1.0]
        for d in range(1, cost.MAX_DEPTH + 1):
            cand = sorted((f * c for f in frontier for c in child), reverse=True)
            depths += [d] * len(cand)
            probs += cand
            frontier = cand[:k]
        pools[k] = [(depths, probs)] * contexts
    return pools


# SmolLM2-135M on this 2-core CPU (BRIEF: ms per forward over n tokens) and a GPU-like flat curve
CPU = cost.Costs("cpu", {1: 0.042, 2: 0.068, 8: 0.060, 16: 0.071, 64: 0.147, 96: 0.22},
                 {k: 0.004 + 0.0005 * k for k in cost.LEVEL_SIZES})
GPU = cost.Costs("gpu", {1: 0.020, 16: 0.0201, 32: 0.0203, 64: 0.021, 96: 0.024},
                 {k: 0.0006 for k in cost.LEVEL_SIZES})


def test_decode_plan_auto_tree_small_on_cpu_large_on_gpu():
    pools = synthetic_pools()
    cpu, cpu_rate = cost.choose(CPU, pools)
    gpu, gpu_rate = cost.choose(GPU, pools)
    assert cpu.total_tokens <= 16 and gpu.total_tokens >= 48, (cpu, gpu)
    assert gpu.depth > cpu.depth
    # the chosen spec beats plain decoding and EAGLE's fixed 60-node tree under each cost model
    for costs, spec, rate in ((CPU, cpu, cpu_rate), (GPU, gpu, gpu_rate)):
        assert rate > 1 / costs.verify(1)
        step = costs.level(2) + 5 * costs.level(8) + costs.verify(61)
        fixed = cost.expected_tokens(pools[8], 6, 60) / step
        assert rate >= fixed


def test_decode_plan_auto_tree_uses_a_lumpy_cpu_curve():
    """Measured on this CPU with packed linears: 2 rows cost more than 3 to 6, then ~1 ms a row. A head
    with a few likely children gets the 5 nodes that fit in the free rows (the old 1/2/4/8 grid and
    candidate list could not express 5), not 6 (the next row costs more than its child adds)."""
    lumpy = cost.Costs("cpu", {1: 0.040, 2: 0.048, 3: 0.040, 4: 0.040, 5: 0.040, 6: 0.041, 7: 0.046, 8: 0.048,
                               16: 0.062, 96: 0.2}, {k: 0.002 for k in cost.LEVEL_SIZES})
    child = [0.2, 0.1, 0.08, 0.06, 0.05, 0.01, 0.01, 0.01, 0.01, 0.01]
    pools = {k: [([1] * k, child[:k])] for k in cost.LEVEL_SIZES}  # depth 1 only
    spec, rate = cost.choose(lumpy, pools)
    assert spec.depth == 1 and spec.total_tokens == 5 and spec.top_k >= 5, spec
    assert rate == pytest.approx((1 + sum(child[:5])) / (0.002 + 0.041))  # a head level + 6 rows


def test_decode_plan_auto_tree_untrained_head_gets_minimal_tree():
    pools = synthetic_pools(untrained=True)
    spec, _ = cost.choose(GPU, pools)
    assert spec.total_tokens <= 2


def test_decode_plan_auto_tree_measures_calibrates_and_caches(tmp_path, monkeypatch):
    from test_decode_core import tiny_head

    t = tiny_target(vocab_size=64, layers=2)
    head = tiny_head(t, "eagle3", 48)
    costs = cost.measure(t, head, prefix_len=16, repeats=1)
    assert set(costs.verify_s) == set(cost.VERIFY_SIZES) and all(v > 0 for v in costs.level_s.values())
    ids = torch.randint(7, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    pools = cost.calibrate(t, head, ids, contexts=2, depth=3, ks=(1, 2, 3))
    assert [len(pools[k][0][0]) for k in (1, 2, 3)] == [3, 2 + 2 * 4, 3 + 2 * 9]
    assert all(0 < p <= 1 for p in pools[3][0][1])
    for depths, probs in pools[1]:  # a chain: each node's path probability is its parent's times its own
        assert depths == [1, 2, 3] and probs == sorted(probs, reverse=True) and probs[2] < probs[0]
    monkeypatch.setattr(cost, "calibration_ids", lambda target: ids)
    spec = cost.auto_plan(t, head, cache_dir=tmp_path).spec
    assert isinstance(spec, TreeSpec) and len(list(tmp_path.glob("*.json"))) == 1
    monkeypatch.setattr(cost, "measure", lambda *a, **k: pytest.fail("cached costs were measured again"))
    assert cost.auto_plan(t, head, cache_dir=tmp_path).spec == spec
    out = decode.generate(t, head, ids[:, :8], 6, eos_token_id=False, tree=spec)
    assert out.stats.new_tokens == 6
    # in-process: the plan is reused without hashing the weights again, until a weight changes in place
    made = cost.auto_plan(t, head, cache_dir=tmp_path)
    assert isinstance(made, cost.Plan) and made.spec == spec and 0 <= made.nodes_with_lookup <= spec.total_tokens
    keys = []
    real_key = cost._key
    monkeypatch.setattr(cost, "_key", lambda *a: keys.append(1) or real_key(*a))
    assert cost.auto_plan(t, head, cache_dir=tmp_path) is made and keys == []
    with torch.no_grad():
        next(head.parameters()).mul_(1.0)  # an in-place write (same values: the file cache still answers)
    again = cost.auto_plan(t, head, cache_dir=tmp_path)
    assert again is not made and again == made and keys == [1]


def test_decode_plan_auto_keeps_fewer_head_nodes_beside_a_lookup_branch(monkeypatch):
    """Where rows cost time (the lumpy CPU curve) a step with a 3-row lookup branch keeps fewer of the
    head's candidates; where verification is flat (GPU) it keeps them all; generate(tree="auto",
    prompt_lookup=...) hands the plan's count to the LookupDrafter."""
    lumpy = cost.Costs("cpu", {1: 0.040, 2: 0.048, 3: 0.040, 4: 0.040, 5: 0.040, 6: 0.041, 7: 0.046, 8: 0.048,
                               16: 0.062, 96: 0.2}, {k: 0.002 for k in cost.LEVEL_SIZES})
    child = [0.2, 0.1, 0.08, 0.06, 0.05, 0.01]
    pool = [([1] * 6, child)]
    spec = TreeSpec(1, 6, 5)
    beside = cost.nodes_beside_branch(lumpy, pool, spec, rows=3, tokens=0.8)
    assert beside < spec.total_tokens
    rate = lambda n: (1 + sum(child[:n]) + 0.8) / (0.002 + lumpy.verify(n + 4))
    assert rate(beside) == max(rate(n) for n in range(6))
    assert cost.nodes_beside_branch(GPU, pool, spec, rows=3, tokens=0.8) == spec.total_tokens
    from test_decode_core import tiny_head

    t = tiny_target(vocab_size=64, layers=2)
    head = tiny_head(t, "eagle3", 48)
    made = cost.Plan(TreeSpec(depth=2, top_k=2, total_tokens=4), expected_tokens_per_s=30.0,
                     plain_tokens_per_s=20.0, nodes_with_lookup=1)
    monkeypatch.setattr(api, "auto_plan", lambda target, head: made)
    built = []
    real = api.LookupDrafter
    monkeypatch.setattr(api, "LookupDrafter", lambda inner, n, **kw: built.append(kw) or real(inner, n, **kw))
    ids = torch.tensor([[2, 5, 6, 7, 5, 6, 7, 5, 6]])
    out = decode.generate(t, head, ids, 12, eos_token_id=False, tree="auto", prompt_lookup=4)
    assert built == [{"inner_nodes": 1}]
    assert torch.equal(out.sequences, decode.generate(t, None, ids, 12, eos_token_id=False).sequences)


def test_decode_plan_auto_falls_back_to_plain_when_no_tree_pays(tmp_path, monkeypatch):
    from test_decode_core import tiny_head

    t = tiny_target(vocab_size=64, layers=2)
    head = tiny_head(t, "eagle3", 48)
    ids = torch.randint(7, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    plain = decode.generate(t, None, ids, 6, eos_token_id=False)
    for expected, plain_rate, drafts in ((5.0, 20.0, False), (30.0, 20.0, True)):
        made = cost.Plan(TreeSpec(depth=2, top_k=2, total_tokens=4), expected, plain_rate)
        monkeypatch.setattr(api, "auto_plan", lambda target, head, made=made: made)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = decode.generate(t, head, ids, 6, eos_token_id=False, tree="auto")
        assert torch.equal(out.sequences, plain.sequences)
        assert (max(out.stats.tree_sizes) > 0) == drafts, "auto drafts exactly when a tree is expected to pay"
        assert any("decoding without drafting" in str(w.message) for w in seen) == (not drafts)


def batch_costs(rows: int) -> cost.Costs:
    """A CPU-like target: a forward costs 40 ms up to 8 tokens in all, then 1.3 ms per token (compute-bound);
    a head level 2 ms per row."""
    verify = {m: 0.040 + 0.0013 * max(rows * m - 8, 0) for m in (1, 2, 3, 4, 6, 8, 16)}
    return cost.Costs("cpu", verify, {k: 0.002 for k in cost.LEVEL_SIZES}, batch_size=rows)


def test_decode_plan_batch_trees_shrink_and_stop_paying():
    """The same head planned for growing batches: the tree shrinks, then no tree pays (plain decoding)."""
    pools = synthetic_pools(accept=0.6)
    specs, pays = {}, {}
    for rows in (1, 2, 4, 16, 64):
        costs = batch_costs(rows)
        spec, rate = cost.choose(costs, pools, max_total=15)
        specs[rows], pays[rows] = spec, rate > rows / costs.verify(1)
    assert pays[1] and pays[2] and not pays[64], pays
    sizes = [specs[r].total_tokens for r in (1, 2, 4, 16)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1], specs
    # one row: the batch-aware chooser is the one-row chooser (no batch_size given = 1)
    one = cost.Costs("cpu", batch_costs(1).verify_s, batch_costs(1).level_s)
    assert cost.choose(one, pools, max_total=15) == cost.choose(batch_costs(1), pools, max_total=15)


def test_decode_plan_auto_per_batch_size(tmp_path, monkeypatch):
    """auto_plan(batch_size=B) measures B × m verify forwards, caches one file per B (the one-row key is
    the key plans had before batches), and generate(tree="auto") on a batch uses the plan for its size."""
    from test_decode_core import tiny_head

    t = tiny_target(vocab_size=64, layers=2)
    head = tiny_head(t, "eagle3", 48)
    ids = torch.randint(7, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(cost, "calibration_ids", lambda target: ids)
    measured = []
    real_measure = cost.measure
    monkeypatch.setattr(cost, "measure", lambda target, head, **kw: measured.append(kw) or real_measure(
        target, head, prefix_len=16, repeats=1, **kw))
    two = cost.auto_plan(t, head, cache_dir=tmp_path, batch_size=2)
    assert two.batch_size == 2 and two.costs["batch_size"] == 2 and measured == [{"batch_size": 2}]
    assert set(map(int, two.costs["verify_s"])) == set(cost.batch_verify_sizes(t.device, 2))
    assert max(map(int, cost.auto_plan(t, head, cache_dir=tmp_path, batch_size=64).costs["verify_s"])) == 4
    assert cost._key(t, head) == cost._key(t, head, 1) != cost._key(t, head, 2)
    assert len(list(tmp_path.glob("*.json"))) == 2
    # generate on a batch asks for the plan of its size, and falls back to plain where it does not pay
    asked = []
    for expected, drafts in ((5.0, False), (30.0, True)):
        made = cost.Plan(TreeSpec(depth=2, top_k=2, total_tokens=4), expected, 20.0, batch_size=3)
        monkeypatch.setattr(api, "auto_plan", lambda target, head, made=made, **kw: asked.append(kw) or made)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = decode.generate(t, head, [[2, 5, 6], [2, 7], [2, 8, 9, 10]], 6, eos_token_id=False, tree="auto")
        assert (max(out.stats.tree_sizes) > 0) == drafts
        assert any("for a batch of 3" in str(w.message) for w in seen) == (not drafts)
    assert asked == [{"batch_size": 3}] * 2


def test_decode_plan_on_a_recurrent_target_prices_the_state_and_plans_chains(tmp_path, monkeypatch):
    """On a target decoding on its model's own cache (a tiny Qwen3.5: Gated DeltaNet layers) the verify costs are
    measured as a drafted step runs (states recorded per position, then cropped back to the prefix); the plan is a
    chain (top_k 1: a tree's path rows are not priced by c(n)), and
    generate(tree="auto") decodes with it as the target decodes alone."""
    from arch_matrix import tiny_target_of
    from transformers.cache_utils import LinearAttentionLayer

    t = tiny_target_of("qwen3_5_text")
    head = decode_head(t)
    recorded = []
    real = LinearAttentionLayer.activate_past_recording
    monkeypatch.setattr(LinearAttentionLayer, "activate_past_recording",
                        lambda self, **kw: recorded.append(kw["recurrent_states_to_keep"]) or real(self, **kw))
    prefix = torch.randint(7, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    costs = cost.verify_costs(t, prefix, repeats=1, sizes=(1, 3))
    assert set(costs) == {1, 3} and {1, 3} <= set(recorded)
    ids = torch.randint(7, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(cost, "calibration_ids", lambda target: ids)
    plan = cost.auto_plan(t, head, cache_dir=tmp_path)
    assert plan.spec.top_k == 1, plan
    assert set(map(int, plan.costs["verify_s"])) == {m for m in cost.VERIFY_SIZES if m <= cost.MAX_DEPTH + 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an untrained head's plan may be plain decoding
        out = decode.generate(t, head, ids[:, :10], 8, eos_token_id=False, tree="auto")
    ref = t.model.generate(ids[:, :10], max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.sequences.tolist() == ref.tolist()
    assert all(size <= plan.spec.total_tokens for size in out.stats.tree_sizes)


def decode_head(t):
    from eaglekit.heads import HeadConfig, build_head

    torch.manual_seed(0)
    return build_head(HeadConfig.from_target(t, kind="eagle3"), t)
