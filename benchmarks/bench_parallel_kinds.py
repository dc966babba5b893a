"""EAGLE-3 vs P-EAGLE vs DFlash vs DSpark side by side (issues 26 and 39): same capture, same wall-clock budget.

Each kind trains one head on the same offline capture (an ``eaglekit prepare`` directory with the EAGLE-3
taps, which all three kinds read) under the same ``optim.max_minutes`` (the cosine follows the time spent,
so every kind ends its schedule at the budget), all runs at once with ``--threads`` torch threads each so a
busy machine slows them alike. Then, per kind:

- held-out per-depth top-1 accuracy, τ_sim and τ_chain: the trainer's own final evaluation on the same
  last ``--eval-samples`` samples (one metric for every kind: a depth counts as a chain would accept it),
  and τ_sim over the first ``--common-depths`` depths so kinds that draft deeper are compared fairly;
- ``eaglekit bench`` on ``--questions`` MT-bench questions (one per category): plain, the head alone
  (``tree=auto``), prompt lookup alone, the head with the lookup graft, HF greedy and HF prompt lookup,
  median of ``--repeats``; τ, tokens/s, speedups and the drafter's seconds per step beside the verify's.

    eaglekit prepare --config configs/prepare-smollm2.yaml output_dir=runs/kinds/features \\
        regenerate.enabled=true num_conversations=1000 max_length=768        # regenerated answers
    python benchmarks/bench_parallel_kinds.py --features runs/kinds/features --out runs/kinds \\
        --minutes 60 --repeats 3                                            # issue 26's full size

Finished runs (``<out>/<kind>/final``) and benches (``<out>/<kind>/bench/``) are reused; a killed run
resumes from its last checkpoint. Writes ``<out>/report.json`` and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eaglekit.fileio import write_json
from eaglekit.train.metrics import tau_sim

ROOT = Path(__file__).resolve().parents[1]
# Each kind's own recipe (head shape, block, objective); the script only swaps in the data and the budget.
CONFIGS = {"eagle3": "configs/smollm2-135m-eagle3.yaml", "peagle": "configs/smollm2-135m-peagle.yaml",
           "dflash": "configs/smollm2-135m-dflash.yaml", "dspark": "configs/smollm2-135m-dspark.yaml"}


def kind_overrides(kind: str, a) -> list[str]:
    """What differs per kind beyond its config: EAGLE-3 trains as many TTT depths as P-EAGLE's block
    (so their τ_sim count the same depths); P-EAGLE's layer count is the knob its paper turns."""
    if kind == "eagle3":
        return [f"loss.ttt_steps={a.common_depths}"]
    if kind == "peagle":
        return [f"head.num_layers={a.peagle_layers}", f"head.block_size={a.common_depths}",
                f"loss.ttt_steps={a.common_depths}"]
    return []


def train(kind: str, a) -> Path:
    out = Path(a.out) / kind
    if (out / "final").is_dir():
        return out
    device = [] if torch.cuda.is_available() else ["--cpu"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *device, "--num_processes", "1", "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "train_head.py"),
           "--config", str(ROOT / CONFIGS[kind]), f"data.features_dir={a.features}", "data.conversations=null",
           f"data.eval_samples={a.eval_samples}", f"data.batch_size={a.batch_size}", f"output_dir={out}",
           f"seed={a.seed}", f"optim.max_minutes={a.minutes}", "optim.epochs=1000",  # the budget ends the run
           f"optim.warmup_steps={a.warmup}", "eval_interval=0", f"save_interval={a.save_interval}", "keep_last=1",
           "trackers=[]", "progress=false", *kind_overrides(kind, a)]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(out.parent / f"{kind}.log", "a") as log:  # appended: a resumed run keeps its first part
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT,
                       env={**os.environ, "OMP_NUM_THREADS": str(a.threads)})
    print(f"{kind}: trained in {time.time() - t0:.0f} s", flush=True)
    return out


def held_out(run: Path, depths: int) -> dict:
    """The trainer's final held-out metrics, plus τ_sim over the first ``depths`` depths."""
    m = json.loads((run / "metrics.json").read_text())
    acc = [m[f"eval_acc_{k}"] for k in range(100) if f"eval_acc_{k}" in m]
    return {"acc": acc, "tau_sim": m["eval_tau_sim"], "tau_chain": m["eval_tau_chain"],
            f"tau_sim_{depths}": tau_sim(acc[:depths]), "steps": m["step"], "train_seconds": m["train_seconds"],
            "train_tokens_per_s": m["tokens_per_s"]}


def bench(kind: str, run: Path, a) -> dict:
    """``eaglekit bench`` of the run's head (cached): every method side by side, median of ``a.repeats``."""
    out = run / "bench"
    done = sorted(out.glob("*.json")) if out.is_dir() else []
    if not done:
        cmd = [str(Path(sys.executable).with_name("eaglekit")), "bench", "target=smollm2-135m-instruct", f"head={run / 'final'}",
               f"prompts={a.questions}", "prompt_order=spread", f"max_new_tokens={a.max_new_tokens}",
               f"repeats={a.repeats}", "temperatures=[0.0]", f"threads={a.bench_threads}",
               f"lookup_tokens={a.lookup_tokens}", f"out={out}"]
        with open(run.parent / f"{kind}-bench.log", "a") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT,
                           env={**os.environ, "OMP_NUM_THREADS": str(a.bench_threads)})
        done = sorted(out.glob("*.json"))
    return summarise_bench(json.loads(done[-1].read_text()))


def summarise_bench(report: dict) -> dict:
    """Per method: tokens/s (median over repeats), τ, speedup vs plain and vs HF lookup, identical outputs;
    for the drafter's methods its ms per step drafting and verifying."""
    res = report["results"]["0.0"]
    tps = {m: r["tokens_per_s"] for m, r in res.items() if isinstance(r, dict) and "tokens_per_s" in r}
    out = {"tree": report["tree"], "load_average": report["load_average"], "date": report["date"], "methods": {}}
    for m, r in res.items():
        if m not in tps:
            continue
        row = {"tokens_per_s": tps[m], "tau": r.get("tau"), "vs_plain": tps[m] / tps["plain"],
               "identical_to_plain": r.get("identical_to_plain")}
        if "hf_lookup" in tps:
            row["vs_hf_lookup"] = tps[m] / tps["hf_lookup"]
        for key in ("draft_s_per_forward", "verify_s_per_forward"):
            if r.get(key) is not None:
                row[key.replace("_s_", "_ms_")] = 1000 * r[key]
        out["methods"][m] = row
    return out


def table(report: dict) -> str:
    rows = [("| kind | steps, train tok/s | held-out acc per depth | τ_sim (first d) | τ_sim (all) | tree | ours ×plain (τ) "
            "| ours+lookup ×plain (τ) | ×HF lookup | draft / verify ms |"), "|" + "---|" * 10]
    depths = f"tau_sim_{report['common_depths']}"
    for kind, r in report["kinds"].items():
        h, b = r["held_out"], r.get("bench", {}).get("methods", {})
        ours, both = b.get("ours", {}), b.get("ours_lookup", {})
        fmt = lambda x, p=2: f"{x:.{p}f}" if isinstance(x, (int, float)) else "–"
        rows.append(f"| {kind} | {h['steps']}, {h['train_tokens_per_s']:.0f} | {' / '.join(f'{x:.3f}' for x in h['acc'])} "
                    f"| {fmt(h[depths], 3)} | {fmt(h['tau_sim'], 3)} "
                    f"| {r.get('bench', {}).get('tree', '–')} | {fmt(ours.get('vs_plain'))}x ({fmt(ours.get('tau'))}) "
                    f"| {fmt(both.get('vs_plain'))}x ({fmt(both.get('tau'))}) | {fmt(both.get('vs_hf_lookup'))}x "
                    f"| {fmt(ours.get('draft_ms_per_forward'), 1)} / {fmt(ours.get('verify_ms_per_forward'), 1)} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", required=True, help="an `eaglekit prepare` capture (EAGLE-3 taps)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kinds", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--minutes", type=float, default=60, help="training wall-clock budget per kind")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per training run (all run at once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--save-interval", type=int, default=50)
    ap.add_argument("--eval-samples", type=int, default=24, help="held-out samples (the capture's last N)")
    ap.add_argument("--common-depths", type=int, default=4, help="EAGLE-3 TTT depths = P-EAGLE block size")
    ap.add_argument("--peagle-layers", type=int, default=2)
    ap.add_argument("--questions", type=int, default=8, help="MT-bench questions, one per category (0: no bench)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lookup-tokens", default="2,5,10")
    ap.add_argument("--bench-threads", type=int, default=1, help="2 threads on 2 shared cores stall (RESULTS, 'Threads on a busy CPU')")
    ap.add_argument("--train-only", action="store_true")
    a = ap.parse_args()
    with ThreadPoolExecutor(len(a.kinds)) as pool:
        runs = dict(zip(a.kinds, pool.map(lambda k: train(k, a), a.kinds)))
    report = {"features": str(a.features), "minutes": a.minutes, "common_depths": a.common_depths,
              "kinds": {k: {"held_out": held_out(run, a.common_depths)} for k, run in runs.items()}}
    if not a.train_only and a.questions:
        for kind, run in runs.items():  # one at a time: each bench times its methods side by side
            report["kinds"][kind]["bench"] = bench(kind, run, a)
    write_json(Path(a.out) / "report.json", report, indent=1)
    print(table(report))


if __name__ == "__main__":
    main()
