"""The exact-law harness shared by the sampling tests: what decode.generate must sample from, enumerated
exactly with transformers' own warpers in float64, and a chi-square check of many seeded runs against it.

Statistic: Pearson chi-square per group (a group = one distribution, e.g. a conditional), cells expected
below 5 pooled into one, groups summed with their degrees of freedom; the p-value from the chi-square
law. A test fails a check below its ALPHA (1e-3: a false-alarm rate of 0.1% per check; seeds are fixed,
so each outcome is deterministic). A token sequence of probability 0 emitted even once gives p = 0.
``acceptance_rule`` swaps the acceptance rule inside generate, so each test can show that the same
check rejects a wrong rule."""
from __future__ import annotations

import contextlib

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from eaglekit import decode
from eaglekit.decode import loop

ALPHA = 1e-3


def hf_probs(logits: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The exact target distribution [V] of ``logits`` [V], as transformers' sampling defines it (float64):
    temperature, then top-k, then top-p."""
    warp = LogitsProcessorList([TemperatureLogitsWarper(cfg["temperature"])]
                               + ([TopKLogitsWarper(cfg["top_k"])] if cfg.get("top_k") else [])
                               + ([TopPLogitsWarper(cfg["top_p"])] if cfg.get("top_p", 1.0) < 1 else []))
    return torch.softmax(warp(None, logits.double()[None]), -1)[0]


@torch.no_grad()
def exact_joint(target, cfg: dict, prompt: list[int], n: int = 3) -> dict[tuple, float]:
    """P(x1..xn | prompt) for every sequence of n tokens the target can sample, enumerated."""
    joint = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, p in joint.items():
            probs = hf_probs(target.model(torch.tensor([prompt + list(seq)])).logits[0, -1], cfg)
            for x in torch.nonzero(probs).flatten().tolist():
                nxt[seq + (x,)] = p * float(probs[x])
        joint = nxt
    return joint


def chi2_pvalue(groups) -> float:
    """``groups``: a list of (counts {cell: n}, probs {cell: p}). The p-value of the summed statistics."""
    stat, df = 0.0, 0
    for counts, probs in groups:
        n = sum(counts.values())
        if n == 0:
            continue
        if any(c and probs.get(k, 0.0) <= 0 for k, c in counts.items()):
            return 0.0  # an impossible outcome
        big = [k for k, p in probs.items() if n * p >= 5]
        small_e = n * sum(p for k, p in probs.items() if n * p < 5)
        small_o = sum(c for k, c in counts.items() if n * probs[k] < 5)
        stat += sum((counts.get(k, 0) - n * probs[k]) ** 2 / (n * probs[k]) for k in big)
        cells = len(big)
        if small_e > 0.5:
            stat += (small_o - small_e) ** 2 / small_e
            cells += 1
        df += max(cells - 1, 0)
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sample_counts(target, drafter, cfg: dict, runs: int, seed: int, prompt: list[int], new_tokens: int,
                  counted: int = 3, **kw) -> tuple[dict[tuple, int], list]:
    """Counts of the first ``counted`` tokens over ``runs`` generations of ``new_tokens`` tokens (one
    generator, seeded once), and each run's DecodeStats. Generate one token more than counted so that the
    first verify gets a tree/chain two levels deep and the acceptance walk really descends."""
    gen = torch.Generator().manual_seed(seed)
    counts, stats = {}, []
    for _ in range(runs):
        out = decode.generate(target, drafter, torch.tensor([prompt]), new_tokens, eos_token_id=False,
                              generator=gen, **cfg, **kw)
        key = tuple(out.sequences[0, len(prompt):len(prompt) + counted].tolist())
        counts[key] = counts.get(key, 0) + 1
        stats.append(out.stats)
    return counts, stats


@contextlib.contextmanager
def acceptance_rule(rule):
    """Inside the block every verify of decode.generate accepts with ``rule`` (a function like
    ``loop.accept_deterministic``) instead of the lossless rule for its tree."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "rule_for", lambda tree: rule)
        yield


def sample_counts_batch(target, drafter, cfg: dict, runs: int, seed: int, prompts: list[list[int]],
                        new_tokens: int, counted: int = 3, **kw) -> tuple[list[dict[tuple, int]], list]:
    """``sample_counts`` for a batch: each run decodes all ``prompts`` together (one generate call, one
    generator seeded once); returns each row's counts of its first ``counted`` new tokens, and each run's
    stats."""
    gen = torch.Generator().manual_seed(seed)
    counts, stats = [{} for _ in prompts], []
    for _ in range(runs):
        out = decode.generate(target, drafter, prompts, new_tokens, eos_token_id=False, generator=gen, **cfg, **kw)
        width = out.sequences.shape[1] - new_tokens
        for b, c in enumerate(counts):
            key = tuple(out.sequences[b, width:width + counted].tolist())
            c[key] = c.get(key, 0) + 1
        stats.append(out.stats)
    return counts, stats
