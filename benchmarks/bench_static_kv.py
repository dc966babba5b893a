"""Tokens/s of ``decode.generate`` on SmolLM2 before and after the preallocated KV cache, and compiled.

One run, side by side: each variant is a worker process holding its own target and head, loaded once
(``--before DIR``: a checkout of an older eaglekit, e.g. ``git worktree add /tmp/before 24174b8``; this
checkout eager; this checkout with ``compile=True``). Workers warm up first (the compiled one compiles every
bucket its runs meet), then take turns: each round times every method once in every worker, one worker at a
time, so a slow spell of a shared machine hits all variants alike. Reported: the median of ``--rounds``
tokens/s per method, and the host syncs per verify step (``bench_host_syncs.SyncCounter``, prefill included).

Methods: plain decoding and a head, one MT-bench prompt (B = 1) and four (B = 4), tree depth 4, top-k 4,
16 nodes. The head is a random EAGLE-3 head (nothing accepted: every step verifies the full tree and the rows
of a batch end together, so the compiled variant meets few shapes), or ``--head DIR`` (a saved head, e.g.
runs/kinds/out/eagle3/final). Prints one JSON object.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_static_kv.py --before /tmp/before
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


# ---- a worker: one eaglekit checkout, one variant ----------------------------------------------------------

def worker(a) -> None:
    import torch

    from eaglekit import assets, decode
    from eaglekit.export import load_head
    from eaglekit.heads import HeadConfig, build_head
    from eaglekit.target import load_target

    sys.path.insert(0, str(HERE))
    from bench_host_syncs import SyncCounter, steps_of

    torch.set_num_threads(a.threads)
    target = load_target("smollm2-135m-instruct")
    if a.head:
        head = load_head(a.head, target)
    else:
        torch.manual_seed(0)
        head = build_head(HeadConfig.from_target(target, kind="eagle3"), target)
    tree = decode.TreeSpec(depth=4, top_k=4, total_tokens=16)
    qs = [q["turns"][0] for q in assets.load_mt_bench()[:4]]
    one, four = target.chat_ids(qs[0]), [target.chat_ids(q)[0] for q in qs]
    extra = {"compile": True} if a.compile else {}
    methods = {"plain_b1": (None, one, {}), "head_b1": (head, one, {"tree": tree}),
               "plain_b4": (None, four, {}), "head_b4": (head, four, {"tree": tree})}

    def gen(name):
        drafter, ids, kw = methods[name]
        return decode.generate(target, drafter, ids, a.max_new_tokens, eos_token_id=False, **kw, **extra)

    for line in sys.stdin:
        cmd, report = line.strip(), {}
        for name in methods:
            if cmd == "warm":
                t0 = time.perf_counter()
                gen(name)
                report[name] = round(time.perf_counter() - t0, 1)
            elif cmd == "syncs":
                with SyncCounter() as c:
                    out = gen(name)
                report[name] = {"syncs_per_step": round(c.count / steps_of(out.stats), 1),
                                "tau": round(out.stats.tau, 2), "tokens": out.stats.new_tokens,
                                "sequences": out.sequences.tolist()}
            else:
                t0 = time.perf_counter()
                out = gen(name)
                report[name] = out.stats.new_tokens / (time.perf_counter() - t0)
        print(json.dumps(report), flush=True)


# ---- the driver ---------------------------------------------------------------------------------------------

def start(name: str, path: Path, a, compile: bool):
    env = dict(os.environ, PYTHONPATH=str(path), OMP_NUM_THREADS=str(a.threads))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    cmd = [sys.executable, __file__, "--worker", "--threads", str(a.threads), "--max-new-tokens",
           str(a.max_new_tokens), "--head", a.head] + (["--compile"] if compile else [])
    return name, subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def ask(proc, cmd: str) -> dict:
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"a worker died on {cmd!r} (its stderr is above)")
    return json.loads(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="an older eaglekit checkout to compare with")
    ap.add_argument("--after", default=str(HERE.parent), help="the checkout measured as 'after' (default: this one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--head", default="", help="a saved head folder (default: a random EAGLE-3 head)")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled variant")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    here = Path(a.after).resolve()
    variants = ([start("before", Path(a.before).resolve(), a, False)] if a.before else []) + \
        [start("after", here, a, False)] + ([] if a.no_compile else [start("after_compiled", here, a, True)])
    report = {"threads": a.threads, "max_new_tokens": a.max_new_tokens, "rounds": a.rounds, "head": a.head,
              "load_average_start": os.getloadavg(), "warm_up_s": {}, "syncs": {}, "tokens_per_s": {}}
    for name, proc in variants:
        report["warm_up_s"][name] = ask(proc, "warm")
    seqs = {}
    for name, proc in variants:
        syncs = ask(proc, "syncs")
        seqs[name] = {m: r.pop("sequences") for m, r in syncs.items()}
        report["syncs"][name] = syncs
    first = next(iter(seqs.values()))
    report["same_tokens_as_first"] = {name: {m: s == first[m] for m, s in got.items()} for name, got in seqs.items()}
    samples = {name: {} for name, _ in variants}
    for _ in range(a.rounds):
        for name, proc in variants:
            for m, v in ask(proc, "run").items():
                samples[name].setdefault(m, []).append(v)
    for name, per in samples.items():
        report["tokens_per_s"][name] = {m: round(statistics.median(v), 2) for m, v in per.items()}
    base = report["tokens_per_s"].get("before")
    if base:
        report["ratio_vs_before"] = {name: {m: round(v / base[m], 3) for m, v in per.items()}
                                     for name, per in report["tokens_per_s"].items() if name != "before"}
    report["load_average_end"] = os.getloadavg()
    for _, proc in variants:
        proc.stdin.close()
        proc.wait()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
