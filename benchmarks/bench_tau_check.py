"""Does the training-time acceptance figure predict decoding? τ_sim / τ_chain vs measured chain τ; and do two
heads differ in decoding? the same held-out prompts decoded by each, with a paired bootstrap CI.

Takes held-out prompts (the last ``--n`` conversations of a regenerated .jsonl, the same samples the
trainer holds out with ``data.eval_samples``), decodes each greedily with a chain of depth K (tree
depth=K, top_k=1) and prints the mean accept length per verify step next to the head's metrics.json.
With several ``--head``, every head decodes every prompt; each later head is compared with the first:
the difference of pooled τ (accepted tokens / verify steps over all prompts) with a 95% CI from a paired
bootstrap over prompts, and how many prompts it decodes with a higher τ.

    python benchmarks/bench_tau_check.py --head runs/gpu-h200/run1/head \
        --data runs/gpu-h200/run2/regenerated.jsonl --metrics runs/gpu-h200/eval-run1/metrics.json
    python benchmarks/bench_tau_check.py --head runs/base/final runs/eagle31/final --data <x>.jsonl --n 64 --depth 3
    python benchmarks/bench_tau_check.py --head runs/base/final runs/eagle31/final --data mt-bench --n 80 --depth 3
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from eaglekit.bench.report import paired_bootstrap


def pooled(tokens: list[int], steps: list[int], idx) -> float:
    return sum(tokens[i] for i in idx) / sum(steps[i] for i in idx)


def per_prompt(rec: dict) -> list[float]:
    """Each prompt's τ: its accepted tokens per verify step."""
    return [a / s for a, s in zip(rec["accepted"], rec["steps"])]


def paired_ci(base: dict, other: dict, n_boot: int = 10000, seed: int = 0) -> dict:
    """Pooled τ of ``other`` minus ``base`` (dicts of per-prompt accepted tokens and steps), paired bootstrap
    over prompts: both heads decoded the same prompts, so a resample keeps each prompt's pair together."""
    n = len(base["steps"])

    def diff(idx):
        return pooled(other["accepted"], other["steps"], idx) - pooled(base["accepted"], base["steps"], idx)

    d, lo, hi = paired_bootstrap(diff, n, n_boot, seed)
    pairs = list(zip(per_prompt(other), per_prompt(base)))
    return {"diff": d, "ci95": [lo, hi], "prompts_higher": sum(o > b for o, b in pairs),
            "prompts_lower": sum(o < b for o, b in pairs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", nargs="+", required=True, help="one head, or several compared with the first")
    ap.add_argument("--target", default="smollm2-135m-instruct", help="the target the head was trained for")
    ap.add_argument("--data", required=True,
                    help="regenerated .jsonl (held-out = its last --n lines), or mt-bench (its first --n questions)")
    ap.add_argument("--metrics", default=None, help="metrics.json of `train_head.py eval_only=true` (one head)")
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default=None, help="write the report (per-prompt counts included) as JSON here")
    a = ap.parse_args()
    from eaglekit import decode
    from eaglekit.decode import TreeSpec
    from eaglekit.export import load_head
    from eaglekit.target import load_target

    target = load_target(a.target)
    heads = [load_head(h, target) for h in a.head]
    if a.data == "mt-bench":
        from eaglekit import assets
        rows = [{"id": f"mt-bench-{q['question_id']}", "messages": [{"role": "user", "content": q["turns"][0]}]}
                for q in assets.load_mt_bench()[:a.n]]
    else:
        rows = [json.loads(line) for line in Path(a.data).read_text().splitlines()]
        rows = [r for r in rows if r["messages"]][-a.n:]
    chain = TreeSpec(depth=a.depth, top_k=1, total_tokens=a.depth)
    per = [{"accepted": [], "steps": []} for _ in heads]
    for r in rows:  # prompt-major: a load change during the run hits every head alike
        ids = target.chat_ids(r["messages"][0]["content"])
        for h, (head, rec) in enumerate(zip(heads, per)):
            out = decode.generate(target, head, ids, max_new_tokens=a.max_new_tokens, tree=chain)
            rec["accepted"].append(sum(out.stats.accept_lengths))
            rec["steps"].append(len(out.stats.accept_lengths))
            print(f"{r['id']} head {h}: τ {out.stats.tau:.2f} over {out.stats.new_tokens} tokens", flush=True)
    report = {"prompts": len(rows), "depth": a.depth, "max_new_tokens": a.max_new_tokens, "heads": []}
    for path, rec in zip(a.head, per):
        report["heads"].append({"head": path, "tau_per_step": pooled(rec["accepted"], rec["steps"], range(len(rows))),
                                "tau_median_prompt": statistics.median(per_prompt(rec)), **rec})
    for h, rec in enumerate(per[1:], 1):
        report["heads"][h]["vs_first"] = paired_ci(per[0], rec)
    if a.metrics:
        m = json.loads(Path(a.metrics).read_text())
        report.update({k: m[k] for k in ("eval_tau_sim", "eval_tau_chain") if k in m})
    if a.out:
        from eaglekit.fileio import write_json
        write_json(Path(a.out), report)
    brief = [{k: v for k, v in h.items() if k not in ("accepted", "steps")} for h in report["heads"]]
    print(json.dumps({**report, "heads": brief}, indent=1))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
