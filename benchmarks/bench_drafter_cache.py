"""Tokens/s of ``decode.generate`` with an EAGLE-3 head on SmolLM2, several eaglekit checkouts side by side.

Made for the drafter's preallocated cache (the head's ``HeadCache``, the rows of one head in one buffer):
each ``--variant NAME=DIR`` is a worker process importing eaglekit from DIR (a ``git clone`` at some commit),
holding its own target and head, loaded and warmed up once; then each round times every method once in
every worker, one worker at a time, so a slow spell of a shared machine hits all variants alike. Reported
per variant and method: the median tokens/s over ``--rounds``, each round's seconds, and a hash of the
outputs (greedy decoding: equal hashes = the same tokens). Methods: one MT-bench prompt (B = 1) and four
(B = 4), tree depth 4, top-k 4, 16 nodes, ``--max-new-tokens`` each, EOS ignored. The head: ``--head``
(a saved head, read only) or a random EAGLE-3 head (seed 0; nothing accepted, every step pays the tree).
Workers run ``--threads`` torch threads with OMP_WAIT_POLICY=PASSIVE unless the caller set a policy.

    python benchmarks/bench_drafter_cache.py --variant before=/tmp/before --variant after=/tmp/after
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

METHODS = ("head_b1", "head_b4")


def worker(args) -> None:
    """Load, warm up, then answer one timed run per method name read from stdin."""
    import torch

    from eaglekit import assets, decode
    from eaglekit.export import load_head
    from eaglekit.heads import HeadConfig, build_head
    from eaglekit.target import load_target

    torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m-instruct")
    torch.manual_seed(0)
    head = load_head(args.head, target) if args.head else build_head(HeadConfig.from_target(target, kind="eagle3"),
                                                                     target)
    tree = decode.TreeSpec(depth=4, top_k=4, total_tokens=16)
    qs = [q["turns"][0] for q in assets.load_mt_bench()[:4]]
    inputs = {"head_b1": target.chat_ids(qs[0]), "head_b4": [target.chat_ids(q)[0] for q in qs]}

    def run(name: str, n: int):
        return decode.generate(target, head, inputs[name], n, eos_token_id=False, tree=tree)

    for name in METHODS:
        run(name, 8)
    print(json.dumps({"ready": decode.__file__}), flush=True)
    for line in sys.stdin:
        name = line.strip()
        t0 = time.perf_counter()
        out = run(name, args.max_new_tokens)
        seconds = time.perf_counter() - t0
        digest = hashlib.sha256(str(out.sequences.tolist()).encode()).hexdigest()[:12]
        print(json.dumps({"seconds": seconds, "tokens": out.stats.new_tokens, "digest": digest}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", default=[], help="NAME=DIR, an eaglekit checkout")
    ap.add_argument("--head", default="", help="a saved EAGLE-3 head for SmolLM2 (default: random)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    if not a.variant:
        ap.error("give at least one --variant NAME=DIR")
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads),
           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    workers = {}
    for spec in a.variant:
        name, _, root = spec.partition("=")
        cmd = [sys.executable, __file__, "--worker", "--threads", str(a.threads), "--max-new-tokens",
               str(a.max_new_tokens)] + (["--head", a.head] if a.head else [])
        workers[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                         env={**env, "PYTHONPATH": root})
    report = {name: {"eaglekit": json.loads(w.stdout.readline())["ready"]} for name, w in workers.items()}
    for _ in range(a.rounds):
        for method in METHODS:
            for name, w in workers.items():
                w.stdin.write(method + "\n")
                w.stdin.flush()
                got = json.loads(w.stdout.readline())
                r = report[name].setdefault(method, {"seconds": [], "digests": set()})
                r["seconds"].append(round(got["seconds"], 3))
                r["tokens"] = got["tokens"]
                r["digests"].add(got["digest"])
    for w in workers.values():
        w.stdin.close()
        w.wait()
    for variant in report.values():
        for method in METHODS:
            r = variant[method]
            r["tokens_per_s"] = round(r["tokens"] / statistics.median(r["seconds"]), 2)
            r["digests"] = sorted(r["digests"])
    print(json.dumps({"threads": a.threads, "max_new_tokens": a.max_new_tokens, "head": a.head or "random",
                      "load_after": os.getloadavg(), "variants": report}))


if __name__ == "__main__":
    main()
