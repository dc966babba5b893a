"""Peak memory of offline training with and without the target's decoder loaded (one process each, side by side).

Training from captured features reads the target's embedding, final norm and lm_head only; since
``data.load_target_decoder`` (None: automatic) it loads nothing else. This runs the same short training twice
on the same capture, ``data.load_target_decoder=true`` (the whole target, as before) and the default, and
reports each process's peak RSS (``os.wait4``'s ``ru_maxrss``), seconds and the losses of both (equal: the
decoder never ran).

    eaglekit prepare --config configs/prepare-smollm2.yaml output_dir=runs/mem/smol num_conversations=64 \\
        max_length=512 draft_vocab_size=8192
    python benchmarks/bench_offline_memory.py --features runs/mem/smol --steps 4 --out runs/mem/smol.json \\
        --set target.dtype=float32
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eaglekit.fileio import write_json

ROOT = Path(__file__).resolve().parents[1]


def run(features: str, steps: int, decoder: bool, extra: list[str], threads: int) -> dict:
    """One short training from ``features``; its peak RSS, seconds and the logged losses."""
    manifest = json.loads((Path(features) / "manifest.json").read_text())
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, str(ROOT / "train_head.py"), f"target={manifest['target']['name']}",
               f"data.features_dir={features}", "data.eval_samples=4", f"optim.max_steps={steps}",
               "eval_interval=0", "save_interval=0", "trackers=[]", "progress=false", f"output_dir={out}",
               f"data.load_target_decoder={str(decoder).lower()}", *extra]
        t0 = time.time()
        proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        if status != 0:
            raise SystemExit(f"training failed ({' '.join(cmd)}):\n{output[-3000:]}")
        log = [json.loads(x) for x in (Path(out) / "log.jsonl").read_text().splitlines()]
    return {"load_target_decoder": decoder, "peak_rss_gib": usage.ru_maxrss / 2**20, "seconds": time.time() - t0,
            "losses": [r["loss"] for r in log if "loss" in r and not r.get("final")]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", required=True, help="an `eaglekit prepare` capture (its target is trained for)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True, help="the JSON report")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="training overrides for both runs")
    a = ap.parse_args()
    whole, borrowed = (run(a.features, a.steps, d, a.set, a.threads) for d in (True, False))
    report = {"features": a.features, "steps": a.steps, "overrides": a.set, "whole_target": whole,
              "borrowed_only": borrowed, "ratio": borrowed["peak_rss_gib"] / whole["peak_rss_gib"],
              "same_losses": whole["losses"] == borrowed["losses"]}
    write_json(a.out, report, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k not in ("whole_target", "borrowed_only")}),
          f"whole {whole['peak_rss_gib']:.2f} GiB, borrowed {borrowed['peak_rss_gib']:.2f} GiB")


if __name__ == "__main__":
    main()
