"""Decode-loop speed on SmolLM2: the same calls before and after a refactor of the loop.

Times ``decode.generate`` (public API only, so any version of eaglekit on the path runs it) for plain
decoding, a random EAGLE-3 head's fixed tree (nothing accepted: the drafting overhead), that tree with a
prompt-lookup branch, and SmolLM2 drafting a small tree for itself (multi-token paths), round-robin over methods and
prompts so that a slow spell of a shared machine hits all alike. Prints one JSON object: per method the
seconds of each repeat (summed over prompts), the tokens, and a hash of every output and accept-length
list (two versions that behave the same print the same hashes).

    PYTHONPATH=/path/to/old/checkout python benchmarks/bench_decode_loop.py --repeats 3 > old.json
    python benchmarks/bench_decode_loop.py --repeats 3 > new.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch

from eaglekit import assets, decode
from eaglekit.decode.cli import use_cpu_linear
from eaglekit.decode.drafters import TreeSpec
from eaglekit.heads import HeadConfig, build_head
from eaglekit.target import load_target

TREE = TreeSpec(depth=3, top_k=4, total_tokens=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target = load_target("smollm2-135m-instruct")
    torch.manual_seed(0)
    head = build_head(HeadConfig.from_target(target, kind="eagle3"), target)
    use_cpu_linear("packed", target, head)
    prompts = [target.chat_ids(q["turns"][0]) for q in assets.load_mt_bench()[: a.prompts]]
    methods = {"plain": {"drafter": None}, "head_tree": {"drafter": head, "tree": TREE},
               "head_tree_lookup": {"drafter": head, "tree": TREE, "prompt_lookup": (2, 5, 10)},
               "self_tree": {"drafter": decode.ModelTreeDrafter(target, target, TreeSpec(2, 2, 3))}}
    run = {name: {"seconds": [], "tokens": 0, "digest": hashlib.sha256()} for name in methods}
    for ids in prompts[:1]:  # warm-up
        for kw in methods.values():
            decode.generate(target, kw["drafter"], ids[:, :16], 8, **{k: v for k, v in kw.items() if k != "drafter"})
    for rep in range(a.repeats):
        for r in run.values():
            r["seconds"].append(0.0)
        for ids in prompts:
            for name, kw in methods.items():
                extra = {k: v for k, v in kw.items() if k != "drafter"}
                t0 = time.perf_counter()
                out = decode.generate(target, kw["drafter"], ids, a.max_new_tokens, **extra)
                run[name]["seconds"][-1] += time.perf_counter() - t0
                if rep == 0:
                    run[name]["tokens"] += out.stats.new_tokens
                    run[name]["digest"].update(json.dumps([out.sequences.tolist(), out.stats.accept_lengths,
                                                                   out.stats.tree_sizes]).encode())
    report = {name: {"seconds": [round(s, 3) for s in r["seconds"]], "tokens": r["tokens"],
                         "digest": r["digest"].hexdigest()[:16]} for name, r in run.items()}
    print(json.dumps({"eaglekit": decode.__file__, "threads": a.threads, "methods": report}))


if __name__ == "__main__":
    main()
