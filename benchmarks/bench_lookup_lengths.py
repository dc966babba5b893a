"""How much of a prompt-lookup branch is accepted, per match length: the data behind ``lookup.BY_MATCH``.

    python benchmarks/bench_lookup_lengths.py --head runs/long-cpu2/eagle3/final --questions 16 --threads 2

Greedy decoding of MT-bench first turns (one per category in turn) with the head's ``tree="auto"`` tree
and a lookup branch of ``--tokens`` tokens whatever the match; prints, per match length n, the steps with
a branch and the share of them whose accepted path began with at least k of the branch's tokens (the
expected value of the branch's k-th token), beside the target's verify cost per row count. A branch
length per n pays while its next token's share is worth more than the row it adds.
"""
from __future__ import annotations

import argparse

import torch

from eaglekit.bench.prompts import load_prompts
from eaglekit.decode import generate
from eaglekit.decode.cli import use_cpu_linear
from eaglekit.decode.cost import auto_plan
from eaglekit.decode.drafters import EagleDrafter
from eaglekit.decode.lookup import LookupDrafter
from eaglekit.export import load_head
from eaglekit.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--head", required=True)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target)
    head = load_head(args.head, target)
    use_cpu_linear("packed", target, head)
    plan = auto_plan(target, head)
    lookup = LookupDrafter(EagleDrafter(target, head, plan.spec), args.tokens)
    for ids in load_prompts(target, "mt-bench", args.questions, "spread"):
        generate(target, lookup, ids, args.max_new_tokens)
    print(f"{args.target} + {args.head}, tree {plan.spec}, {args.questions} MT-bench questions, "
          f"{args.max_new_tokens} tokens, branch of {args.tokens}")
    ks = range(1, args.tokens + 1)
    print("| match n | steps | " + " | ".join(f">= {k}" for k in ks) + " |")
    print("|---" * (args.tokens + 2) + "|")
    for n, counts in sorted(lookup.accepted_by_match.items()):
        steps = sum(counts.values())
        shares = [sum(c for got, c in counts.items() if got >= k) / steps for k in ks]
        print(f"| {n} | {steps} | " + " | ".join(f"{s:.2f}" for s in shares) + " |")
    verify = {int(m): s for m, s in plan.costs["verify_s"].items()}
    print("verify ms per rows: " + ", ".join(f"{m}: {s * 1e3:.1f}" for m, s in sorted(verify.items()) if m <= 16))


if __name__ == "__main__":
    main()
