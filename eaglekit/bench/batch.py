"""``eaglekit bench batch_sizes=[1,2,4,8,16]``: plain batched decoding vs drafting, per batch size.

The same prompts at every batch size B, sorted by length (less padding in a group) and decoded in
consecutive groups of B (B = 1: one at a time, through the one-sequence loop), methods interleaved per
group so machine drift hits all alike (their order balanced over groups: ``methods.method_order``): ``plain`` (our
batched loop, no drafter: the baseline at that B), ``ours`` (the head's or draft model's drafts, always
drafting: a head drafts the tree ``tree=`` names, "auto" meaning the one-row plan's), ``auto`` (a head
with ``tree="auto"`` planned for that B: plain decoding where no tree is expected to pay) and, with
``lookup_tokens``, ``lookup`` (prompt lookup alone). Per (temperature, B, method): tokens/s (median over
repeats of the total over the prompts; end to end, and of the decode phase alone: the prefill, which a
batch pads and which drafting does not speed up, left out), the speedup over plain at that B (paired: the median of each repeat's ratio), τ (mean
over rows), the decode tokens per batched forward (the batch's own τ: B × τ where rows end together, less
where a group waits for its slowest row), and the speedup expected from the measured acceptance per depth and step costs (``theory``;
Leviathan's formula too for a draft model's chain), to set beside the decode-phase speedup. The report
also gives the drafter's memory beside the target's.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from eaglekit.bench.methods import run_in_order
from eaglekit.bench.plots import plot_batch
from eaglekit.bench.prompts import load_questions
from eaglekit.bench.report import rates
from eaglekit.bench.theory import expectations, memory, memory_lines
from eaglekit.decode import cost
from eaglekit.decode.api import generate
from eaglekit.decode.cli import load_models, parse_tree, with_draft_tree
from eaglekit.decode.stats import DecodeStats
from eaglekit.fileio import write_text
from eaglekit.timing import load_average


def batch_methods(cfg, target, drafter, tree) -> dict:
    """name -> fn(prompts, temperature, seed) -> (BatchStats, sequences) (``prompts``: a list of 1-D prompts)."""
    def method(dr, tree=tree, lookup=0):
        def fn(prompts, temp, seed):
            out = generate(target, dr, prompts, cfg.max_new_tokens, temperature=temp, seed=seed, tree=tree,
                           gamma=cfg.gamma, prompt_lookup=lookup, compile=cfg.compile)
            return out.stats, out.sequences
        return fn

    out = {"plain": method(None)}
    if drafter is not None:
        out["ours"] = method(with_draft_tree(cfg, target, drafter))
        if cfg.head and cfg.tree == "auto":
            out["auto"] = method(drafter, tree="auto")
    if cfg.lookup_tokens:
        out["lookup"] = method(None, lookup=cfg.lookup_tokens)
    return out


def run_batch_bench(cfg) -> dict:
    target, drafter, packed = load_models(cfg)
    tree = parse_tree(cfg.tree)
    if tree == "auto" and cfg.head:  # "ours" always drafts: the one-row plan's tree
        tree = cost.auto_plan(target, drafter)
    sizes = sorted({int(b) for b in cfg.batch_sizes})
    if sizes[0] < 1:
        raise ValueError(f"batch_sizes must be >= 1, got {cfg.batch_sizes}")
    questions = load_questions(cfg.dataset, max(cfg.prompts, sizes[-1]), cfg.prompt_order)
    prompts = sorted((target.chat_ids(text)[0] for _, text in questions), key=len)
    fns = batch_methods(cfg, target, drafter, tree)
    plans = {}
    for b in sizes:  # warm-up at every shape (and tree="auto"'s plan per batch size, measured here)
        for fn in fns.values():
            fn([p[:16] for p in prompts[:b]], 0.0, 0)
        if "auto" in fns:
            made = cost.auto_plan(target, drafter, batch_size=b)
            plans[b] = {"tree": str(made.spec), "drafting_pays": made.drafting_pays,
                        "expected_tokens_per_s": made.expected_tokens_per_s,
                        "plain_tokens_per_s": made.plain_tokens_per_s}
    results = {str(t): bench_batch_temperature(cfg, fns, prompts, sizes, t) for t in cfg.temperatures}
    return {"config": asdict(cfg), "mode": "batch", "tree": str(getattr(tree, "spec", tree)), "auto_plans": plans,
            "memory": memory(drafter, target, len(prompts[-1]) + cfg.max_new_tokens),  # sorted: the longest last
            "device": str(target.device), "threads": torch.get_num_threads(), "packed_linears": packed,
            "torch": torch.__version__, "load_average": load_average(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results}


def bench_batch_temperature(cfg, fns: dict, prompts: list, sizes: list[int], temp: float) -> dict:
    """{B: {method: summary}}: every method on every group of B prompts, ``cfg.repeats`` times."""
    out = {}
    for b in sizes:
        groups = [prompts[i:i + b] for i in range(0, len(prompts), b)]
        runs = {name: [] for name in fns}
        pooled = {name: DecodeStats() for name in fns}
        for rep in range(cfg.repeats):
            # tokens, s, row taus, draft s, verify s, forwards, decode-phase tokens and s, rows equal to plain's
            totals = {name: [0, 0.0, [], 0.0, 0.0, 0, 0, 0.0, 0] for name in fns}
            for i, group in enumerate(groups):
                done = run_in_order(fns, rep * len(groups) + i, group, temp, cfg.seed + 1000 * rep + i)
                plain = done["plain"][0][1].cpu()
                for name, ((stats, seq), dt) in done.items():
                    t = totals[name]
                    t[0] += stats.new_tokens
                    t[1] += dt
                    t[2] += [r.tau for r in stats.rows if r.accept_lengths]
                    t[3] += stats.draft_s
                    t[4] += stats.verify_s
                    t[5] += stats.forwards
                    t[6] += stats.new_tokens - len(group)  # the prefill emits each row's first token
                    t[7] += stats.total_s - stats.prefill_s
                    t[8] += sum(torch.equal(a, b) for a, b in zip(seq.cpu(), plain))
                    pooled[name].pool(stats)
            for name, (n, dt, taus, draft_s, verify_s, forwards, dn, ds, same) in totals.items():
                runs[name].append({"tokens": n, "seconds": dt, "tokens_per_s": n / dt,
                                   # greedy: a lossless method gives plain's tokens, row for row
                                   "identical_to_plain": f"{same}/{len(prompts)}" if temp == 0 else None,
                                   "decode_tokens_per_s": dn / ds if ds else None,
                                   "tau": sum(taus) / len(taus) if taus else None,
                                   "draft_s_per_forward": draft_s / max(forwards, 1),
                                   "verify_s_per_forward": verify_s / max(forwards, 1),
                                   # the batch's own τ: a group runs until its slowest row ends
                                   "tokens_per_forward": dn / max(forwards, 1)})
        out[str(b)] = summarise_batch(runs, pooled, cfg.gamma, drafted_by_chain=bool(cfg.draft and not cfg.draft_tree))
    return out


def summarise_batch(runs: dict, pooled: dict, gamma: int, drafted_by_chain: bool) -> dict:
    """Medians over repeats; speedups over plain paired by repeat (the median of each repeat's ratio, and
    their range: one repeat's methods ran interleaved group by group, so machine drift cancels in the
    ratio); the expected speedups (``theory``) from the pooled steps."""
    def med(name, key):
        return statistics.median(r[key] for r in runs[name])

    def ratios(name, key):  # per repeat: each repeat's plain ran beside it, group by group
        return [r[key] / p[key] for r, p in zip(runs[name], runs["plain"])]

    plain_step = med("plain", "verify_s_per_forward")
    out = {}
    for name, rs in runs.items():
        taus = [r["tau"] for r in rs if r["tau"] is not None]
        decode = ratios(name, "decode_tokens_per_s")
        row = {"tokens_per_s": med(name, "tokens_per_s"),
               "speedup_vs_plain": statistics.median(ratios(name, "tokens_per_s")),
               "decode_tokens_per_s": med(name, "decode_tokens_per_s"),
               "decode_speedup_vs_plain": statistics.median(decode),
               "decode_speedup_range": [min(decode), max(decode)],
               "tau": statistics.median(taus) if taus else None, "acceptance_per_depth": rates(pooled[name]),
               "tokens_per_forward": med(name, "tokens_per_forward"),
               **expectations(pooled[name], med(name, "draft_s_per_forward"), med(name, "verify_s_per_forward"),
                              plain_step, gamma if name == "ours" and drafted_by_chain else None),
               "identical_to_plain": ", ".join(r["identical_to_plain"] for r in rs if r["identical_to_plain"]),
               "repeats": rs}
        out[name] = row
    return out


def write_batch(report: dict, out_dir: str) -> Path:
    """The report as ``<target>-<drafter>-<dataset>-batch.json`` and its PNG beside it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = report["config"]
    stem = "-".join(Path(str(x)).name for x in (c["target"], c["head"] or c["draft"] or "plain", c["dataset"]))
    path = write_text(out / f"{stem}-batch.json", json.dumps(report, indent=1))
    plot_batch(report, path.with_suffix(".png"))
    return path


def batch_table(report: dict) -> str:
    head = ("| T | B | method | tokens/s | speedup vs plain | decode phase: tokens/s, speedup (range over repeats) | τ "
            "| tokens per forward | expected speedup | same tokens as plain |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for temp, per_b in report["results"].items():
        for b, res in per_b.items():
            for name, r in res.items():
                tau = f"{r['tau']:.2f}" if r["tau"] else ""
                lo, hi = r["decode_speedup_range"]
                exp = f"{r['expected_speedup']:.2f}x" if r['expected_speedup'] is not None else ""
                if "expected_speedup_leviathan" in r:
                    exp += f" (Leviathan {r['expected_speedup_leviathan']:.2f}x, α {r['alpha']:.2f}, c {r['cost_ratio_c']:.2f})"
                lines.append(f"| {temp} | {b} | {name} | {r['tokens_per_s']:.1f} | {r['speedup_vs_plain']:.2f}x "
                             f"| {r['decode_tokens_per_s']:.1f}, {r['decode_speedup_vs_plain']:.2f}x ({lo:.2f}–{hi:.2f}) | {tau} "
                             f"| {r['tokens_per_forward']:.2f} | {exp} "
                             f"| {r['identical_to_plain']} |")
    return "\n".join(lines + [""] + memory_lines(report["memory"]))
