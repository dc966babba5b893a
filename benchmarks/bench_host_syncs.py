"""Host syncs per decode step and tokens/s on SmolLM2, one prompt and a batch of four, plain and with a head.

A host sync is a call that turns a tensor into a Python value (``Tensor.item``, ``tolist``, ``__bool__``,
``__int__``, ``__float__``): on a GPU each one waits for every queued kernel. They are counted while
``decode.generate`` runs (the prefill's few included) and divided by the verify steps; ``--where`` also
prints the source lines that make them. Uses only the public ``decode.generate`` so an older checkout
runs it too (``PYTHONPATH=/old/checkout python benchmarks/bench_host_syncs.py``). The head is random
(nothing is accepted: every step pays the full tree), EAGLE-3 with the issue's tree: depth 4, top-k 4,
16 nodes. Prints one JSON object; tokens/s is the median of ``--repeats`` runs, methods interleaved.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
import traceback

import torch

from eaglekit import assets, decode
from eaglekit.heads import HeadConfig, build_head
from eaglekit.target import load_target

SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__")


class SyncCounter:
    """Counts tensor → Python conversions while active; ``where`` keeps the calling line of each."""

    def __init__(self, where: bool = False):
        self.count, self.where, self.sites = 0, where, collections.Counter()

    def __enter__(self):
        self.saved = {m: getattr(torch.Tensor, m) for m in SYNC_METHODS}
        for m, fn in self.saved.items():
            setattr(torch.Tensor, m, self._wrap(fn))
        return self

    def __exit__(self, *exc):
        for m, fn in self.saved.items():
            setattr(torch.Tensor, m, fn)

    def _wrap(self, fn):
        def counted(t, *a, **k):
            self.count += 1
            if self.where:
                frame = traceback.extract_stack(limit=2)[0]  # the line that called the conversion
                self.sites[f"{frame.filename.rsplit('eaglekit/', 1)[-1]}:{frame.lineno}"] += 1
            return fn(t, *a, **k)
        return counted


def steps_of(stats) -> int:
    return getattr(stats, "forwards", 0) or len(stats.accept_lengths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--where", action="store_true", help="print the lines that sync, per method")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target = load_target("smollm2-135m-instruct")
    torch.manual_seed(0)
    head = build_head(HeadConfig.from_target(target, kind="eagle3"), target)
    tree = decode.TreeSpec(depth=4, top_k=4, total_tokens=16)
    qs = [q["turns"][0] for q in assets.load_mt_bench()[:4]]
    one = target.chat_ids(qs[0])
    four = [target.chat_ids(q)[0] for q in qs]
    methods = {"plain_b1": (None, one, {}), "head_b1": (head, one, {"tree": tree}),
               "plain_b4": (None, four, {}), "head_b4": (head, four, {"tree": tree})}
    report = {}
    for name, (drafter, ids, kw) in methods.items():  # warm-up, and the sync count (not timed)
        decode.generate(target, drafter, ids, 4, eos_token_id=False, **kw)
        with SyncCounter(a.where) as c:
            out = decode.generate(target, drafter, ids, a.max_new_tokens, eos_token_id=False, **kw)
        steps = steps_of(out.stats)
        report[name] = {"syncs_per_step": round(c.count / steps, 1), "steps": steps, "seconds": []}
        if a.where:
            print(name, c.sites.most_common(25), file=sys.stderr)
    for _ in range(a.repeats):
        for name, (drafter, ids, kw) in methods.items():
            t0 = time.perf_counter()
            out = decode.generate(target, drafter, ids, a.max_new_tokens, eos_token_id=False, **kw)
            report[name]["seconds"].append(round(time.perf_counter() - t0, 3))
            report[name]["tokens"] = out.stats.new_tokens
    for r in report.values():
        r["tokens_per_s"] = round(r["tokens"] / statistics.median(r["seconds"]), 2)
    print(json.dumps({"eaglekit": decode.__file__, "threads": a.threads, "max_new_tokens": a.max_new_tokens,
                      "methods": report}))


if __name__ == "__main__":
    main()
