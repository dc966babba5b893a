"""Batched greedy exactness on real targets (fp32): each row of a batch equals the target's own unbatched
greedy decoding of its prompt (transformers' ``generate``), prompts of different lengths, rows ending at
different steps (an EOS taken from one row's answer), with no drafter, an untrained EAGLE-3 head's tree,
prompt lookup (alone and on the head's tree) and, on Qwen, the model drafting for itself (τ per row high).
A divergence is excused only at a measured near-tie (test_decode_real.assert_same_or_near_tie)."""
import os

import pytest
import torch
from test_decode_real import assert_same_or_near_tie, fitted_head, hf_greedy, mt_bench_prompts, random_head

from eaglekit import decode
from eaglekit.decode.drafters import TreeSpec

# ~50 s (SmolLM2) and ~70 s (Qwen) on the shared 2-core VM under load
pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def references(target, prompts, n):
    """Each prompt's greedy answer alone, with an EOS (token 4 of the first answer) that ends that row at
    step 5 and the others where it first appears in theirs, if it does."""
    free = [hf_greedy(target, p, n)[0, p.shape[1]:].tolist() for p in prompts]
    eos = next(t for i, t in enumerate(free[0]) if i >= 4 and t not in free[0][:i])
    return eos, [with_eos(target, p, answer, n, eos) for p, answer in zip(prompts, free)]


def with_eos(target, prompt, answer: list[int], n: int, eos: int) -> torch.Tensor:
    """transformers' greedy decoding of ``prompt`` stopped at ``eos``: the free greedy ``answer`` (the shared
    reference) up to its first ``eos``, that token included, for greedy decoding's first tokens do not depend
    on where it stops (checked: equal to generate(eos_token_id=eos) for every prompt here). An answer the
    model's own EOS cut short is decoded again with ``eos`` alone."""
    if eos in answer or len(answer) == n:
        return torch.tensor([prompt[0].tolist() + answer[:answer.index(eos) + 1 if eos in answer else n]])
    # the mask given: with an EOS that is not the pad id, transformers would mask the prompt's pad-id tokens
    return target.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
                                 eos_token_id=eos, temperature=None, top_p=None, top_k=None)


def check_rows(target, out, prompts, refs, n, where) -> int:
    """Near-ties among the rows of ``out``; fails on any other difference."""
    width, ties = out.sequences.shape[1] - n, 0
    for b, (p, ref) in enumerate(zip(prompts, refs)):
        k = out.stats.rows[b].new_tokens
        row = torch.cat([p[0], out.sequences[b, width:width + k].cpu()])[None]
        ties += assert_same_or_near_tie(target, ref, row, f"{where} row {b}")
    return ties


def run_batch_checks(target, prompts, n, drafters: dict, **kw) -> dict:
    eos, refs = references(target, prompts, n)
    assert len({r.shape[1] - p.shape[1] for r, p in zip(refs, prompts)}) > 1, "rows must end at different steps"
    ties, stats = 0, {}
    for name, dr in drafters.items():
        lookup = dr.pop("prompt_lookup", 0) if isinstance(dr, dict) else 0
        drafter = dr["drafter"] if isinstance(dr, dict) else dr
        out = decode.generate(target, drafter, [p[0] for p in prompts], n, eos_token_id=eos, prompt_lookup=lookup,
                              **kw)
        ties += check_rows(target, out, prompts, refs, n, name)
        stats[name] = out.stats
    assert ties <= 1, f"{ties} near-tie divergences"
    return stats


def test_decode_batch_real_smollm2(smollm2):
    t = smollm2
    prompts = mt_bench_prompts(t, 4)
    assert len({p.shape[1] for p in prompts}) == 4
    head = random_head(t, "eagle3")
    stats = run_batch_checks(t, prompts, 16, {"plain": None, "head": head, "lookup": {"drafter": None, "prompt_lookup": 5},
                                              "head+lookup": {"drafter": head, "prompt_lookup": 5}},
                             tree=TreeSpec(depth=3, top_k=4, total_tokens=10))
    assert max(max(r.tree_sizes, default=0) for r in stats["head"].rows) == 10


def test_decode_batch_real_qwen05(qwen05_packed):
    t, gamma = qwen05_packed, 3
    prompts = mt_bench_prompts(t, 3)
    stats = run_batch_checks(t, prompts, 8, {"plain": None, "head": random_head(t, "eagle3"), "self": t,
                                              "lookup": {"drafter": None, "prompt_lookup": 5}},
                             tree=TreeSpec(depth=2, top_k=2, total_tokens=3), gamma=gamma)
    for b, row in enumerate(stats["self"].rows):  # drafting for itself every proposal is right
        assert row.tau > 2 and row.path_lengths == [d + 1 for d in row.tree_depths], (b, row.accept_lengths)


def test_decode_batch_real_trained_head(smollm2, tmp_path_factory):
    """The trained head (test_decode_real.fitted_head, trained once per session) in a batch of 4: each row its
    own greedy output, rows accepting trees to their full depth beside rows that accept less or have ended."""
    t = smollm2
    head = fitted_head(t, tmp_path_factory.mktemp("fitted"))
    stats = run_batch_checks(t, mt_bench_prompts(t, 4), 24, {"head": head}, tree=TreeSpec(depth=4, top_k=4, total_tokens=16))
    if not os.environ.get("EAGLEKIT_TEST_HEAD"):
        rows = stats["head"].rows
        assert max(max(r.path_lengths) for r in rows) == 5 and min(min(r.path_lengths) for r in rows) < 5
