"""Lossless sampling: the joint distribution of the first 3 generated tokens, enumerated exactly from
the target (with transformers' own temperature / top-k / top-p warpers), against the empirical
distribution of many runs of decode.generate — plain, draft-model chain, EAGLE tree and draft-model tree
drafting, and an EAGLE tree with a prompt-lookup branch.

Statistic: Pearson chi-square over the joint cells (cells expected below 5 pooled into one), p-value
from the chi-square law; a run fails below ALPHA = 1e-3, i.e. a false-alarm rate of 0.1% per check
(seeds are fixed, so each check's outcome is deterministic). A token sequence of probability 0
emitted even once fails at once. The deliberately wrong rule (min(1, p/q) on top-k candidates) must
fail the same check."""

import pytest
import torch
from helpers import tiny_target

from eaglekit import decode
from eaglekit.decode.sampling import Sampling, accept_minpq_on_topk

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest

V, PROMPT, NEW, ALPHA = 16, [2, 8, 9, 10], 3, 1e-3
CONFIG = dict(temperature=0.8, top_p=0.9, top_k=6)


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


def exact_joint(target, cfg, n=NEW, prompt=PROMPT) -> dict[tuple, float]:
    """Enumerate P(x1..xn | prompt) with transformers' warpers (temperature, then top-k, then top-p)."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warp = LogitsProcessorList([TemperatureLogitsWarper(cfg["temperature"])]
                               + ([TopKLogitsWarper(cfg["top_k"])] if cfg["top_k"] else [])
                               + ([TopPLogitsWarper(cfg["top_p"])] if cfg["top_p"] < 1 else []))
    joint = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, p in joint.items():
            ids = torch.tensor([prompt + list(seq)])
            logits = warp(ids, target.model(ids).logits[:, -1].double())
            probs = torch.softmax(logits, -1)[0]
            for x in torch.nonzero(probs).flatten().tolist():
                nxt[seq + (x,)] = p * float(probs[x])
        joint = nxt
    return joint


def sample_runs(target, drafter, cfg, runs, seed=0, prompt=PROMPT, **kw) -> tuple[dict[tuple, int], list[int]]:
    """Counts of the first NEW tokens. Drafted runs generate NEW + 1 tokens so that the first verify
    gets a depth-2 tree/chain and the acceptance walk really descends below the first level."""
    gen = torch.Generator().manual_seed(seed)
    counts, lengths = {}, []
    n = NEW if drafter is None else NEW + 1
    for _ in range(runs):
        out = decode.generate(target, drafter, torch.tensor([prompt]), n, eos_token_id=False, generator=gen,
                              **cfg, **kw)
        key = tuple(out.sequences[0, len(prompt):len(prompt) + NEW].tolist())
        counts[key] = counts.get(key, 0) + 1
        lengths += out.stats.accept_lengths
    return counts, lengths


def chi_square_pvalue(exact: dict, counts: dict) -> float:
    n = sum(counts.values())
    impossible = set(counts) - set(exact)
    if impossible:
        return 0.0
    big = [s for s, p in exact.items() if n * p >= 5]
    small_e = n * sum(p for s, p in exact.items() if n * p < 5)
    small_o = sum(c for s, c in counts.items() if n * exact[s] < 5)
    stat = sum((counts.get(s, 0) - n * exact[s]) ** 2 / (n * exact[s]) for s in big)
    cells = len(big)
    if small_e > 0:
        stat += (small_o - small_e) ** 2 / small_e
        cells += 1
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_decode_sampling_warpers_match_transformers():
    """Sampling.probs (used by generate) equals transformers' warpers on random logits."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    for temp, top_k, top_p in [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.6, 20, 0.9), (1.0, 1, 0.5)]:
        logits = torch.randn(4, 50, generator=g) * 3
        ref = TemperatureLogitsWarper(temp)(None, logits.clone())
        ref = TopKLogitsWarper(top_k)(None, ref) if top_k else ref
        ref = TopPLogitsWarper(top_p)(None, ref) if top_p < 1 else ref
        torch.testing.assert_close(Sampling(temp, top_p, top_k).probs(logits), torch.softmax(ref, -1))


@pytest.fixture(scope="module")
def setup():
    from test_decode_core import tiny_head

    target = peaky_target(0)
    head = tiny_head(target, "eagle3", draft_vocab=12)
    head.lm_head.weight.data.mul_(20.0)  # a confident (but untrained) drafter: realistic q
    return target, head, peaky_target(0, noise=0.5), exact_joint(target, CONFIG)


TREE = dict(depth=2, top_k=5, total_tokens=10)


@pytest.mark.parametrize("mode", ["plain", "chain", "tree", "model_tree"])
def test_decode_sampling_matches_target_distribution(setup, mode):
    target, head, draft, exact = setup
    model_tree = decode.ModelTreeDrafter(target, draft, decode.TreeSpec(**TREE))
    drafter = {"plain": None, "chain": draft, "tree": head, "model_tree": model_tree}[mode]
    counts, lengths = sample_runs(target, drafter, CONFIG, runs=1000, seed=1, tree=TREE, gamma=2)
    p = chi_square_pvalue(exact, counts)
    assert p > ALPHA, (mode, p)
    if mode != "plain":  # drafts were accepted down to depth 2, so the walk was exercised
        assert max(lengths) == 3 and sum(lengths) / len(lengths) > 1.1, lengths


def test_decode_sampling_check_catches_wrong_rule(setup):
    """min(1, p/q) on deterministic top-k candidates is biased: the same check must reject it."""
    target, head, draft, exact = setup
    counts, _ = sample_runs(target, head, CONFIG, runs=500, seed=1, tree=TREE,  # half the runs: still rejected
                            acceptance=accept_minpq_on_topk)
    assert chi_square_pvalue(exact, counts) < ALPHA


def test_decode_sampling_with_lookup_matches_target_distribution(setup):
    """An EAGLE tree with a prompt-lookup branch grafted on: every token is in the prompt, so lookup
    proposes a chain at every step, sharing head nodes or adding its own; the law must still hold."""
    from eaglekit.decode.drafters import EagleDrafter
    from eaglekit.decode.lookup import LookupDrafter

    target, head, _, _ = setup
    prompt = list(range(1, V)) + [0, 3, 1]
    dr = LookupDrafter(EagleDrafter(target, head, decode.TreeSpec(**TREE)), 3)
    counts, lengths = sample_runs(target, dr, CONFIG, runs=1000, seed=1, prompt=prompt)
    p = chi_square_pvalue(exact_joint(target, CONFIG, prompt=prompt), counts)
    assert p > ALPHA, p
    # lookup proposed at every step with room to draft (the last step of a run has none)
    assert dr.matches > len(lengths) // 2 and dr.accepted > 50, (dr.matches, len(lengths), dr.accepted)
