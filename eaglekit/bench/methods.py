"""The bench's methods: name -> fn(ids, temperature, seed) -> (new tokens, DecodeStats or None, sequences).

``plain`` (our loop, no drafter: the baseline), ``ours`` (our loop with the head or draft model), with
``lookup_tokens`` ``lookup`` and ``ours_lookup`` (a prompt-lookup branch, alone and grafted onto ours),
``hf`` (transformers' ``generate``), ``hf_lookup`` (its prompt lookup decoding) and, with a draft model,
``hf_assisted_<k>`` (its assisted generation, same pair, k draft tokens).
"""
from __future__ import annotations

import torch

from eaglekit.decode.api import generate
from eaglekit.decode.cli import with_draft_tree
from eaglekit.timing import timed


def methods(cfg, target, drafter, tree) -> dict:
    """name -> fn(ids, temperature, seed) -> (new tokens, DecodeStats or None, sequences).
    ``tree``: generate's ``tree`` for a head, e.g. its ``Plan`` resolved once (used as ``tree="auto"`` uses
    it, but always drafting: no fallback to plain decoding)."""
    def ours(dr, lookup=0):
        def fn(ids, temp, seed):
            out = generate(target, dr, ids, cfg.max_new_tokens, temperature=temp, seed=seed, tree=tree,
                           gamma=cfg.gamma, prompt_lookup=lookup, compile=cfg.compile)
            return out.stats.new_tokens, out.stats, out.sequences
        return fn

    def hf(**kw):
        def fn(ids, temp, seed):
            torch.manual_seed(seed)
            sample = {"do_sample": True, "temperature": temp, "top_p": 1.0, "top_k": 0} if temp > 0 else \
                {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
            seq = target.model.generate(ids.to(target.device), max_new_tokens=cfg.max_new_tokens, **sample,
                                        **kw)
            return seq.shape[1] - ids.shape[1], None, seq
        return fn

    out = {"plain": ours(None)}
    dr = None if drafter is None else with_draft_tree(cfg, target, drafter)
    if dr is not None:
        out["ours"] = ours(dr)
    if cfg.lookup_tokens:
        out["lookup"] = ours(None, cfg.lookup_tokens)
        if cfg.head or cfg.draft_tree:  # a tree of chosen tokens (a draft-model chain is sampled)
            out["ours_lookup"] = ours(dr, cfg.lookup_tokens)
    if cfg.hf_baselines:
        out["hf"] = hf()
        out["hf_lookup"] = hf(prompt_lookup_num_tokens=cfg.prompt_lookup_tokens)
        if cfg.draft:  # fixed-length drafts, as our loop does (no dynamic schedule or early stop)
            gc = drafter.model.generation_config
            gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = "constant", 0.0
            for k in cfg.assistant_tokens:
                out[f"hf_assisted_{k}"] = _assisted(hf, drafter, k)
    return out


def _assisted(hf, drafter, k):
    inner = hf(assistant_model=drafter.model)

    def fn(ids, temp, seed):
        drafter.model.generation_config.num_assistant_tokens = k
        return inner(ids, temp, seed)
    return fn


def method_order(names: list[str], k: int) -> list[str]:
    """The methods' order for the k-th run: row k of a balanced Latin square (Williams), so over n runs
    (2n for an odd n) each method runs first once and right after each other method once; a heavy method
    can leave the next one a colder cache or a hotter CPU, and no method always pays for that."""
    n = len(names)
    first = [0]
    for j in range(1, n):
        first.append((j + 1) // 2 if j % 2 else n - j // 2)
    row = [names[(x + k) % n] for x in first]
    return row[::-1] if n % 2 and (k // n) % 2 else row


def run_in_order(fns: dict, k: int, *args) -> dict:
    """Every method on the same ``args``, in ``method_order``'s k-th order: name -> (its result, seconds)."""
    return {name: timed(lambda fn=fns[name]: fn(*args)) for name in method_order(list(fns), k)}
