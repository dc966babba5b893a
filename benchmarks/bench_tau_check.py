"""Does the training-time acceptance figure predict decoding? τ_sim / τ_chain vs measured chain τ.

Takes held-out prompts (the last ``--n`` conversations of a regenerated .jsonl, the same samples the
trainer holds out with ``data.eval_samples``), decodes each greedily with a chain of depth K (tree
depth=K, top_k=1) and prints the mean accept length per verify step next to the head's metrics.json.

    python benchmarks/bench_tau_check.py --head runs/gpu-h200/run1/head \
        --data runs/gpu-h200/run2/regenerated.jsonl --metrics runs/gpu-h200/eval-run1/metrics.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", required=True)
    ap.add_argument("--target", default="smollm2-135m-instruct", help="the target the head was trained for")
    ap.add_argument("--data", required=True, help="regenerated .jsonl (held-out = its last --n lines)")
    ap.add_argument("--metrics", default=None, help="metrics.json of `train_head.py eval_only=true`")
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    a = ap.parse_args()
    from eaglekit import decode
    from eaglekit.decode.tree import TreeSpec
    from eaglekit.heads import load_head
    from eaglekit.target import load_target

    target = load_target(a.target)
    head = load_head(a.head, target)
    rows = [json.loads(line) for line in Path(a.data).read_text().splitlines()]
    rows = [r for r in rows if r["messages"]][-a.n:]
    chain = TreeSpec(depth=a.depth, top_k=1, total_tokens=a.depth)
    taus, lengths = [], []
    for r in rows:
        ids = target.chat_ids(r["messages"][0]["content"])
        out = decode.generate(target, head, ids, max_new_tokens=a.max_new_tokens, tree=chain)
        taus.append(out.stats.tau)
        lengths += out.stats.accept_lengths
        print(f"{r['id']}: τ {out.stats.tau:.2f} over {out.stats.new_tokens} tokens", flush=True)
    report = {"prompts": len(rows), "depth": a.depth, "tau_per_step": sum(lengths) / len(lengths),
              "tau_median_prompt": statistics.median(taus)}
    if a.metrics:
        m = json.loads(Path(a.metrics).read_text())
        report.update({k: m[k] for k in ("eval_tau_sim", "eval_tau_chain") if k in m})
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
