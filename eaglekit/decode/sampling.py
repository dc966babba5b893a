"""The distribution we must match (temperature, top-k, top-p → p) and the acceptance rules.

An acceptance rule decides, at one tree node whose target distribution is ``p``, which of the node's
drafted children (tried in draft order) is accepted, and returns the distribution left to sample from
when all are rejected. Which rule is lossless depends on how the children were proposed:

* ``accept_deterministic`` — children chosen deterministically (EAGLE top-k): each is a one-hot
  proposal, so child x is accepted with probability p(x); on rejection p(x) = 0 and p is renormalised,
  then the next child is tried; if all are rejected, the next token is sampled from what is left.
* ``accept_sampled`` — children sampled from the drafter's q (a draft model's chain): Leviathan et al.
  accept with min(1, p(x)/q(x)), else the residual norm(max(p − q, 0)) (SpecInfer's form for several
  i.i.d. children from the same q).
* ``accept_minpq_on_topk`` — the classic mistake (min(1, p/q) on deterministically chosen candidates),
  kept only so tests can show that the sampling check catches a wrong rule.

``rule_for(tree)`` picks the lossless rule for a tree. At temperature 0 every rule reduces to "accept the
child equal to argmax p", which ``verify.accept`` does directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy. Order as in transformers: temperature, then top-k, then top-p."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    # temperature 0: a field, not a property, so the decode step reads it without a call into this module
    greedy: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "greedy", self.temperature == 0)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Target/draft distribution over the last dim (float32); one-hot argmax when greedy."""
        logits = logits.float()
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        p = torch.softmax(logits, dim=-1)
        if self.top_p < 1:
            sorted_p, order = torch.sort(p, dim=-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
            drop_sorted = before >= self.top_p  # keep the smallest prefix reaching top_p (>= 1 token)
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            p = p.masked_fill(drop, 0.0)
            p = p / p.sum(-1, keepdim=True)
        return p


def sample(p: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from the (unnormalised, non-negative) distribution ``p`` [V]."""
    if generator is not None and generator.device != p.device:  # e.g. a CPU generator and CUDA p:
        p = p.to(generator.device)  # draw on the generator's device (multinomial refuses a mix)
    return int(torch.multinomial(p, 1, generator=generator))


def _uniform(p: torch.Tensor, generator) -> float:
    device = p.device if generator is None else generator.device  # rand refuses a generator elsewhere
    return float(torch.rand((), generator=generator, device=device))


def accept_deterministic(p, tokens, q_token, q_full, generator):
    """One-hot proposals (top-k children): accept x w.p. p(x)/Σp, else zero it and try the next."""
    p = p.clone()
    for i, x in enumerate(tokens):
        if _uniform(p, generator) * float(p.sum()) < float(p[x]):
            return i, p
        p[x] = 0.0
    return None, p


def accept_sampled(p, tokens, q_token, q_full, generator):
    """Leviathan: children x_i ~ q i.i.d.; accept w.p. min(1, p(x)/q(x)), else p ← norm(max(p − q, 0))."""
    p = p / p.sum()
    for i, x in enumerate(tokens):
        q = q_full[i].to(p.device)  # a draft model may sit on another device than the target
        if _uniform(p, generator) * float(q[x]) < float(p[x]):
            return i, p
        rest = (p - q).clamp_min(0.0)
        total = float(rest.sum())
        if total <= 0:  # p == q: a rejection cannot happen; keep p
            continue
        p = rest / total
    return None, p


def rule_for(tree):
    """The lossless rule for how ``tree``'s nodes were proposed: sampled from q (a draft model's chain) or
    chosen (top-k, prompt lookup)."""
    return accept_sampled if tree.sampled else accept_deterministic


def accept_minpq_on_topk(p, tokens, q_token, q_full, generator):
    """WRONG on top-k candidates (biased toward the draft); only for tests that must catch it."""
    p = p.clone()
    for i, x in enumerate(tokens):
        if _uniform(p, generator) * float(q_token[i]) * float(p.sum()) < float(p[x]):
            return i, p
        p[x] = 0.0
    return None, p
