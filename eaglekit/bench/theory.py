"""What speculative decoding should give, from what a run measured: the expected speedup beside the measured
one, and what a drafter costs in memory beside a draft model.

* Chains (Leviathan et al. 2023): a draft of γ tokens, each accepted with probability α, a draft token
  costing c target forwards: speedup = (1 − α^(γ+1)) / ((1 − α)(γc + 1)).
* Trees: E[tokens per verify] = 1 + Σ_d Π_{j≤d} a_j from the measured rate a_j at which depth j is
  accepted once depth j-1 was (``step_rates``: a tree that does not reach depth j counts as a miss there,
  so trees of varying depth, e.g. a lookup branch, are weighed right), times what a plain step costs over
  what a drafted step costs (its drafting + its verify forward, measured). The product telescopes to the
  mean accepted path, so this accounts for the measured speedup by acceptance × step costs; what is left
  between the two is time outside drafting and verifying, and rows leaving a batch.
"""
from __future__ import annotations

import math


def leviathan_speedup(alpha: float, gamma: int, c: float) -> float:
    """Expected walltime speedup of a γ-token chain accepted with probability α per token, a draft token
    costing ``c`` target forwards (Leviathan et al., Theorem 3.8)."""
    tokens = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + 1)


def expected_tokens(rates: list) -> float:
    """1 + Σ_d Π_{j≤d} a_j: the expected tokens per verify forward of drafts whose depth-d node is accepted
    with probability a_d given depth d-1 was (None or NaN: no step reached that depth, the sum stops)."""
    total, reach = 1.0, 1.0
    for r in rates:
        if r is None or math.isnan(r):
            break
        reach *= r
        total += reach
    return total


def tree_speedup(rates: list, draft_s: float, verify_s: float, plain_s: float) -> float:
    """Expected speedup of a drafter accepted at ``rates`` per depth, a step drafting ``draft_s`` and
    verifying ``verify_s`` seconds, against a plain step of ``plain_s`` seconds (each per verify forward)."""
    return expected_tokens(rates) * plain_s / (draft_s + verify_s)


def step_rates(stats) -> list[float | None]:
    """a_d = #steps accepting >= d drafted tokens / #steps accepting >= d-1, counted on the accepted paths
    before an EOS or stop cut (``DecodeStats.path_lengths``), whether or not the tree reached depth d."""
    out = []
    for d in range(1, max(stats.tree_depths, default=0) + 1):
        alive = sum(1 for a in stats.path_lengths if a >= d)
        out.append(sum(1 for a in stats.path_lengths if a >= d + 1) / alive if alive else None)
    return out


def pooled_alpha(stats) -> float | None:
    """α: drafted tokens accepted / drafted tokens tried, over every step and depth (the acceptance rates per
    depth pooled; Leviathan's α when acceptance does not depend on depth). None without a drafted token."""
    ok = tried = 0
    for path, depth in zip(stats.path_lengths, stats.tree_depths):
        accepted = min(path - 1, depth)
        ok += accepted
        tried += accepted + (accepted < depth)  # the first rejected depth was tried too
    return ok / tried if tried else None


def expectations(stats, draft_s: float, verify_s: float, plain_s: float, gamma: int | None = None) -> dict:
    """What a method's measured steps predict: its acceptance rates per depth (``step_rates`` over ``stats``,
    every prompt's steps pooled), the tree formula's speedup from them and its step costs (seconds per verify
    forward: drafting ``draft_s``, verifying ``verify_s``; a plain step ``plain_s``) and, for a draft model's
    chain of ``gamma`` tokens, Leviathan's formula from the pooled α and c = (draft s per token) / plain_s."""
    accepted = step_rates(stats)
    out = {"step_rates": accepted, "draft_s_per_forward": draft_s, "verify_s_per_forward": verify_s,
           "expected_speedup": tree_speedup(accepted, draft_s, verify_s, plain_s)
           if plain_s and draft_s + verify_s else None}  # None: no step was timed
    alpha = pooled_alpha(stats)
    if gamma and alpha is not None and plain_s:
        c = draft_s / gamma / plain_s
        out.update(alpha=alpha, cost_ratio_c=c, expected_speedup_leviathan=leviathan_speedup(alpha, gamma, c))
    return out


# ---- memory ------------------------------------------------------------------------------------------

def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_value: int) -> int:
    """Keys and values of one token in every layer."""
    return 2 * layers * kv_heads * head_dim * bytes_per_value


def _params(module) -> tuple[int, int]:
    params = list(module.parameters())
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def head_memory(head) -> dict:
    """An EAGLE head's own parameters (the target's embedding it borrows not counted) and its KV per token."""
    cfg = head.config
    count, size = _params(head)
    size += sum(b.numel() * b.element_size() for b in head.buffers())  # d2t/t2d maps
    width = next(head.parameters()).element_size()
    return {"kind": cfg.kind, "parameters": count, "bytes": size,
            "kv_bytes_per_token": kv_bytes_per_token(cfg.num_layers, cfg.num_key_value_heads, cfg.head_dim, width)}


def model_memory(target) -> dict:
    """A whole model (a target, or a draft model): parameters and KV per token, from its config."""
    cfg = target.config
    count, size = _params(target.model)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    width = next(target.model.parameters()).element_size()
    return {"name": target.name, "parameters": count, "bytes": size,
            "kv_bytes_per_token": kv_bytes_per_token(cfg.num_hidden_layers, kv_heads, head_dim, width)}


def drafter_memory(drafter) -> dict | None:
    """``head_memory`` or ``model_memory`` of what ``eaglekit bench`` drafted with (None: no drafter)."""
    if drafter is None:
        return None
    return model_memory(drafter) if hasattr(drafter, "tokenizer") else head_memory(drafter)


def memory(drafter, target, context_tokens: int) -> dict:
    """The drafter's memory beside the target's (a draft model is a whole model of its own, a head borrows the
    target's embedding): parameters, parameter bytes, KV bytes per token and at ``context_tokens`` (the
    longest prompt plus the new tokens of a run: the cache each one holds at its end)."""
    out = {}
    for name, m in (("drafter", drafter_memory(drafter)), ("target", model_memory(target))):
        out[name] = m and {**m, "context_tokens": context_tokens,
                           "kv_bytes_at_context": m["kv_bytes_per_token"] * context_tokens}
    return out


def memory_lines(mem: dict) -> list[str]:
    """One line per model of ``memory``'s block, for the benches' tables."""
    lines = []
    for what, m in mem.items():
        if m:
            at = (f", {m['kv_bytes_at_context'] / 2**20:.1f} MiB at {m['context_tokens']} tokens"
                  if "kv_bytes_at_context" in m else "")
            lines.append(f"{what}: {m.get('name') or m.get('kind')}: {m['parameters'] / 1e6:.1f}M parameters, "
                         f"{m['bytes'] / 2**20:.0f} MiB, KV {m['kv_bytes_per_token'] / 1024:.1f} KiB per token{at}")
    return lines
