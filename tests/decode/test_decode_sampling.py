"""Lossless sampling: the joint distribution of the first 3 generated tokens, enumerated exactly from
the target (with transformers' own temperature / top-k / top-p warpers), against the empirical
distribution of many runs of decode.generate — plain, draft-model chain, EAGLE tree and draft-model tree
drafting, and an EAGLE tree with a prompt-lookup branch (chi-square, ALPHA = 1e-3 per check: see
exact_law.py). The deliberately wrong rule (min(1, p/q) on top-k candidates) must fail the same check."""

import pytest
import torch
from exact_law import ALPHA, acceptance_rule, chi2_pvalue, exact_joint, hf_probs, sample_counts
from helpers import GreedyChain, tiny_target
from test_decode_core import tiny_head

from eaglekit import decode
from eaglekit.decode.drafters import EagleDrafter
from eaglekit.decode.lookup import LookupDrafter
from eaglekit.decode.loop import Sampling, accept_minpq_on_topk

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest

V, PROMPT, NEW = 16, [2, 8, 9, 10], 3
CONFIG = {"temperature": 0.8, "top_p": 0.9, "top_k": 6}


def peaky_target(seed, vocab=V, noise=0.0):
    """A tiny random target whose next-token distributions are far from uniform; ``noise`` > 0 gives a
    perturbed copy of seed's model (a draft model that is often, not always, right)."""
    t = tiny_target(seed=seed, vocab_size=vocab, layers=2, hidden=16)
    t.lm_head.weight.data.mul_(40.0)
    if noise:
        g = torch.Generator().manual_seed(123)
        for w in t.model.parameters():
            w.data.add_(noise * w.data.std() * torch.randn(w.shape, generator=g))
    return t


def sample_runs(target, drafter, cfg, runs, seed=0, prompt=PROMPT, **kw) -> tuple[dict[tuple, int], list[int]]:
    """Counts of the first NEW tokens, and every verify's accept length. Drafted runs generate NEW + 1 tokens
    so that the first verify gets a depth-2 tree/chain and the acceptance walk really descends."""
    n = NEW if drafter is None else NEW + 1
    counts, stats = sample_counts(target, drafter, cfg, runs, seed, prompt, n, counted=NEW, **kw)
    return counts, [a for s in stats for a in s.accept_lengths]


def test_decode_sampling_warpers_match_transformers():
    """Sampling.probs (used by generate) equals transformers' warpers on random logits."""
    g = torch.Generator().manual_seed(0)
    for temp, top_k, top_p in [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.6, 20, 0.9), (1.0, 1, 0.5)]:
        logits = torch.randn(4, 50, generator=g) * 3
        ref = torch.stack([hf_probs(row, {"temperature": temp, "top_k": top_k, "top_p": top_p}) for row in logits])
        torch.testing.assert_close(Sampling(temp, top_p, top_k).probs(logits), ref.float())


@pytest.fixture(scope="module")
def setup():
    target = peaky_target(0)
    head = tiny_head(target, "eagle3", draft_vocab=12)
    head.lm_head.weight.data.mul_(20.0)  # a confident (but untrained) drafter: realistic q
    return target, head, peaky_target(0, noise=0.5), exact_joint(target, CONFIG, PROMPT)


TREE = {"depth": 2, "top_k": 5, "total_tokens": 10}


@pytest.mark.parametrize("mode", ["plain", "chain", "tree", "model_tree"])
def test_decode_sampling_matches_target_distribution(setup, mode):
    target, head, draft, exact = setup
    model_tree = decode.ModelTreeDrafter(target, draft, decode.TreeSpec(**TREE))
    drafter = {"plain": None, "chain": draft, "tree": head, "model_tree": model_tree}[mode]
    counts, lengths = sample_runs(target, drafter, CONFIG, runs=1000, seed=1, tree=TREE, gamma=2)
    p = chi2_pvalue([(counts, exact)])
    assert p > ALPHA, (mode, p)
    if mode != "plain":  # drafts were accepted down to depth 2, so the walk was exercised
        assert max(lengths) == 3 and sum(lengths) / len(lengths) > 1.1, lengths


def test_decode_sampling_check_catches_wrong_rule(setup):
    """min(1, p/q) on deterministic top-k candidates is biased: the same check must reject it."""
    target, head, _draft, exact = setup
    with acceptance_rule(accept_minpq_on_topk):
        counts, _ = sample_runs(target, head, CONFIG, runs=500, seed=1, tree=TREE)  # half the runs: still rejected
    assert chi2_pvalue([(counts, exact)]) < ALPHA


def test_decode_sampling_with_lookup_matches_target_distribution(setup):
    """An EAGLE tree with a prompt-lookup branch grafted on: every token is in the prompt, so lookup
    proposes a chain at every step, sharing head nodes or adding its own; the law must still hold."""
    target, head, _, _ = setup
    prompt = list(range(1, V)) + [0, 3, 1]
    dr = LookupDrafter(EagleDrafter(target, head, decode.TreeSpec(**TREE)), 3)
    counts, lengths = sample_runs(target, dr, CONFIG, runs=1000, seed=1, prompt=prompt)
    p = chi2_pvalue([(counts, exact_joint(target, CONFIG, prompt))])
    assert p > ALPHA, p
    # lookup proposed at every step with room to draft (the last step of a run has none)
    assert dr.matches > len(lengths) // 2 and dr.accepted > 50, (dr.matches, len(lengths), dr.accepted)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_decode_sampling_on_a_recurrent_target_keeps_its_law(shape):
    """Sampling on a tiny peaky Qwen3.5 (Gated DeltaNet layers: its recurrent state recorded per verified position,
    the rejected tail rolled back) with a deterministic chain, or a binary tree verified one row per path (the
    one-hot rule; the rollback is the same for a draft model's sampled drafts): the joint law of the first 3 tokens
    over 400 seeded runs against the target's, enumerated; drafts accepted to depth 2, so rollbacks of 0, 1 and 2
    nodes all happen (a tree's from any of its 4 path rows)."""
    import transformers
    from arch_matrix import BASE, GDN
    from helpers import TreeOracle, tiny_tokenizer

    from eaglekit.target import Target

    config = transformers.Qwen3_5TextConfig(**{**BASE, **GDN, "num_hidden_layers": 4, "vocab_size": V})
    torch.manual_seed(0)
    t = Target(transformers.Qwen3_5ForCausalLM(config).eval(), tiny_tokenizer(V), name="peaky-qwen3.5")
    t.lm_head.weight.data.mul_(40.0)
    assert t.own_cache and t.chain_refusal() is None
    exact = exact_joint(t, CONFIG, PROMPT)
    drafter = GreedyChain(t, depth=2) if shape == "chain" else TreeOracle(t, depth=2, ranks=(2, 0))
    counts, lengths = sample_runs(t, drafter, CONFIG, runs=400, seed=1, tree={"depth": 2, "top_k": 2, "total_tokens": 6})
    assert chi2_pvalue([(counts, exact)]) > ALPHA
    assert {1, 2, 3} <= set(lengths), sorted(set(lengths))


@pytest.mark.slow
def test_decode_sampling_with_an_mtp_head_keeps_the_law():
    """Sampling with an MTP head (a fresh layer of a peaky tiny DeepSeek-V3's own MLA + MoE block, fitted 3 steps
    on the target's answers so that its drafts are partly accepted) drafting trees 2 deep: the joint law of the
    first 3 tokens over 400 seeded runs against the target's, enumerated; rollbacks of 0, 1 and 2 nodes happen."""
    import transformers
    from arch_matrix import MATRIX, config
    from helpers import fit_mtp, hf_greedy, tiny_tokenizer

    from eaglekit.heads import HeadConfig, build_head
    from eaglekit.target import Target

    cfg = config(MATRIX["deepseek_v3"])
    cfg.vocab_size = V
    torch.manual_seed(0)
    t = Target(transformers.DeepseekV3ForCausalLM(cfg).eval(), tiny_tokenizer(V), name="peaky-deepseek-v3")
    t.lm_head.weight.data.mul_(40.0)
    torch.manual_seed(1)
    head = build_head(HeadConfig.from_target(t, kind="mtp"), t)
    fit_mtp(head, t, [p + hf_greedy(t, p, 12)[0, len(p):].tolist() for p in (PROMPT, [3, 4, 5, 6])], steps=3)
    exact = exact_joint(t, CONFIG, PROMPT)
    counts, lengths = sample_runs(t, head.eval(), CONFIG, runs=400, seed=1,
                                  tree={"depth": 2, "top_k": 2, "total_tokens": 4})
    assert chi2_pvalue([(counts, exact)]) > ALPHA
    assert {1, 2, 3} <= set(lengths), sorted(set(lengths))
