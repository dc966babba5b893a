"""The GPU recipe for a lent device: regenerate ShareGPT with SmolLM2 → train an EAGLE-3 head → bench it.

Made for a lent GPU with a hard wall-clock budget, 64 MiB carried each way and no second try, in one call
(``--step all``) or two (``--step regen``, then ``--step train`` on the JSONL the first brought back):

* ``regen``: a one-batch probe, then regeneration until the budget's deadline (the run is killed there;
  regeneration appends whole batches and resumes, so only the batch in flight is lost), cut to what
  gzips into ``--max-gz-mib``; brings back ``regenerated.jsonl.gz`` (in parts if over 15 MiB),
  ``draft_vocab.safetensors`` and ``prepare.json`` (counts).
* ``train``: joins and unzips ``--regen-dir``'s JSONL, trains with ``optim.max_minutes`` = what the
  budget leaves after the bench reserve, evaluates held-out τ_sim every ``eval_interval`` steps (the
  data-scaling record ``data_scaling.json``/``.png``), benches on this device (``tree="auto"``, plain,
  lookup, HF and HF lookup; then the batch bench and T=1 while time is left) and brings back the head
  (``head.tar``, in parts) and ``results.tar.gz`` (logs, metrics, bench JSON/PNG, records).

Every result is copied under ``--out`` as soon as it exists, so a run cut short still returns what it
finished. ``--device cpu`` with tiny sizes proves the path without a GPU (tests/test_gpu_recipe.py). Run by
``benchmarks/gpu/run.sh``; documented in docs/benchmarks.md ("On a GPU").
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from gpu_io import (
    gzip_prefix,
    join_parts,
    regen_counts,
    scaling_record,
    sh,
    tar_files,
    whole_lines,
    write_parts,
    write_scaling,
)

from eaglekit import assets
from eaglekit.fileio import write_bytes, write_json

T0 = time.perf_counter()
TARGET = "smollm2-135m-instruct"
REGENERATED = "regenerated.jsonl"


def start_clock() -> None:
    """The budget counts from here (main's start), not from the import."""
    global T0
    T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def left(a) -> float:
    return a.budget_s - elapsed()


def log(msg: str) -> None:
    print(f"[{elapsed():6.0f}s] {msg}", flush=True)


# ---- step 1: regeneration --------------------------------------------------------------------------
def source_json(path: Path, work: Path) -> Path:
    """The ShareGPT subset as a .json file prepare reads (a .gz is unpacked into ``work``)."""
    if path.suffix != ".gz":
        return path
    dst = work / path.name.removesuffix(".gz")
    with gzip.open(path, "rb") as src:
        write_bytes(dst, src.read())
    return dst


def prepare_cmd(a, data: Path, source: Path) -> list[str]:
    return [sys.executable, "-m", "eaglekit.cli", "prepare", "--config", "configs/prepare-smollm2.yaml",
            f"output_dir={data}", f"data={source}", f"max_turns={a.max_turns}", "capture=false",
            "draft_vocab_size=8192", "regenerate.enabled=true", f"regenerate.max_new_tokens={a.new_tokens}",
            f"regenerate.max_prompt_tokens={a.max_prompt_tokens}", f"regenerate.batch_size={a.batch}",
            f"target.device={a.device}", "target.dtype=float32", "progress=false"]


def regenerate(a, work: Path, until: float, summary: dict) -> Path:
    """Regenerate into ``work/data`` until ``until`` seconds of the budget; return the data folder."""
    data = work / "data"
    cmd = prepare_cmd(a, data, source_json(Path(a.sharegpt), work))
    t = time.perf_counter()
    try:  # a one-batch probe (what a batch costs, and a failure found early), then as many as fit: killed
        # at the deadline, regeneration keeps the whole batches it appended
        summary["regen_probe_s"] = sh(cmd + [f"num_conversations={a.batch}"], until - elapsed())
        room = until - elapsed() - a.finish_reserve_s
        used_up = len(whole_lines(data / REGENERATED)) < a.batch  # the source held no more than a batch
        more = not used_up and (a.max_conversations == 0 or a.max_conversations > a.batch)
        if more and room > summary["regen_probe_s"]:
            sh(cmd + [f"num_conversations={a.max_conversations}"], room)
    except subprocess.TimeoutExpired:
        summary["regen_cut_at_deadline"] = True
        log("regeneration stopped at its deadline; the whole batches it wrote are kept")
    summary["regen_s"] = time.perf_counter() - t
    return data


def finish_regen(a, data: Path, out: Path, summary: dict) -> dict:
    """Cut the JSONL to whole lines that gzip into the cap, build the draft vocab and the counts from
    exactly those (prepare reading the regenerated file itself, on the CPU), bring back the gzip (in
    parts), the vocab and prepare.json."""
    from eaglekit.config import load_config  # torch: only where this step runs
    from eaglekit.data_prep.prepare import PrepareConfig, run_prepare

    path = data / REGENERATED
    lines = whole_lines(path)
    if not lines:
        raise SystemExit(f"{path}: no conversation was regenerated within the budget")
    blob, keep = gzip_prefix(lines, int(a.max_gz_mib * 2**20))
    if keep < len(lines) or path.stat().st_size != sum(len(x) + 1 for x in lines):  # a cap, or a torn line
        write_bytes(path, b"".join(x + b"\n" for x in lines[:keep]))
    cfg = load_config(PrepareConfig, "configs/prepare-smollm2.yaml", [
        f"data={path}", "num_conversations=0", "max_turns=0", f"output_dir={data}", "draft_vocab_size=8192",
        "capture=false", "target.device=cpu", "target.dtype=float32", "progress=false"])
    counts = run_prepare(cfg)
    record = {**regen_counts(lines[:keep]), **counts, "lines_dropped_for_size": len(lines) - keep,
              "gz_bytes": len(blob), "max_turns": a.max_turns, "max_new_tokens": a.new_tokens,
              "batch": a.batch, "probe_s": summary.get("regen_probe_s"), "regen_s": summary.get("regen_s"),
              "cut_at_deadline": summary.get("regen_cut_at_deadline", False), "device": a.device}
    record["conversations_per_s"] = record["conversations"] / max(record["regen_s"] or 0.0, 1e-9)
    record["files"] = write_parts(blob, out, REGENERATED + ".gz")
    write_bytes(out / "draft_vocab.safetensors", (data / "draft_vocab.safetensors").read_bytes())
    write_json(data / "prepare.json", record)
    write_json(out / "prepare.json", record)
    log(f"regenerated {record['conversations']:,} conversations ({record['assistant_turns']:,} answers, "
        f"{record['tokens']:,} tokens) → {', '.join(record['files'])}")
    return record


# ---- step 2: training ------------------------------------------------------------------------------
def unpack_regen(regen_dir: Path, data: Path) -> Path:
    """``regen_dir``'s JSONL (``regenerated.jsonl``, or its ``.gz`` whole or in parts) into ``data``, with
    the draft vocab and prepare.json beside it when they came along."""
    data.mkdir(parents=True, exist_ok=True)
    if (regen_dir / REGENERATED).is_file():
        write_bytes(data / REGENERATED, (regen_dir / REGENERATED).read_bytes())
    else:
        write_bytes(data / REGENERATED, gzip.decompress(join_parts(regen_dir, REGENERATED + ".gz")))
    for name in ("draft_vocab.safetensors", "prepare.json"):
        if (regen_dir / name).is_file():
            write_bytes(data / name, (regen_dir / name).read_bytes())
    return data


def train(a, work: Path, data: Path, summary: dict) -> Path:
    """Train to the budget minus the bench reserve; return the head's folder."""
    minutes = max(a.min_train_minutes, (left(a) - a.bench_reserve_s - 45) / 60)
    interval = a.eval_interval or max(1, int(a.steps_per_s * 60 * minutes / a.eval_points))
    summary.update(train_budget_min=round(minutes, 2), eval_interval=interval)
    launch = [sys.executable, "-m", "accelerate.commands.launch", *(["--cpu"] if a.device == "cpu" else []),
              "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    vocab = data / "draft_vocab.safetensors"
    cmd = launch + ["train_head.py", "--config", a.train_config, f"data.conversations={data / REGENERATED}",
                    *([f"data.draft_vocab={vocab}"] if vocab.is_file() else []), f"output_dir={work / 'head'}",
                    f"optim.max_minutes={minutes:.2f}", f"eval_interval={interval}", "log_interval=1",
                    "save_interval=0", "trackers=[]", "progress=false", *a.train_set]
    env = {**os.environ, **({"DS_ACCELERATOR": "cpu"} if a.device == "cpu" else {})}
    summary["train_wall_s"] = sh(cmd, 60 * minutes + a.train_slack_s, env=env)
    return work / "head"


def bring_head_back(head: Path, out: Path, summary: dict) -> None:
    """The final head's folder as one tar (weights barely compress), in parts under 16 MiB."""
    tarball = head / "final.tar"
    with tarfile.open(tarball, "w") as tar:
        tar.add(head / "final", arcname="final")
    summary["head_files"] = write_parts(tarball.read_bytes(), out, "head.tar")
    tarball.unlink()


def bench_runs(a) -> dict[str, list[str]]:
    """The benches, most wanted first: T=0 with every baseline, the batch bench (small then large
    batches, so that the first fits even when the second does not), T=1."""
    sizes = [int(b) for b in a.batch_sizes.split(",") if b]
    small, large = [b for b in sizes if b <= 8], [b for b in sizes if b > 8]
    one = [f"prompts={a.bench_prompts}", "prompt_order=spread", f"max_new_tokens={a.bench_tokens}"]
    batch = ["temperatures=[0.0]", "prompt_order=spread", f"max_new_tokens={a.batch_tokens}"]
    runs = {"main": one + ["temperatures=[0.0]", "lookup_tokens=2,5,10"],
            "batch": batch + [f"batch_sizes=[{','.join(map(str, small))}]", f"prompts={max(small or [1])}"],
            "batch-large": batch + [f"batch_sizes=[{','.join(map(str, large))}]", f"prompts={max(large or [1])}"],
            "t1": one + ["temperatures=[1.0]", "hf_baselines=false"],
            "bf16": one + ["temperatures=[0.0]", "dtype=bfloat16"]}
    if not small:
        runs.pop("batch")
    if not large:
        runs.pop("batch-large")
    return {name: runs[name] for name in a.benches.split(",") if name in runs}


def bench(a, head: Path, work: Path, out: Path, summary: dict) -> None:
    base = [sys.executable, "-m", "eaglekit.cli", "bench", f"target={TARGET}", f"head={head / 'final'}",
            f"device={a.device}", "dtype=float32", f"repeats={a.bench_repeats}"]
    for name, extra in bench_runs(a).items():
        room = left(a) - 10
        if room < a.bench_min_s:
            log(f"skipping bench {name}: {room:.0f}s left")
            summary.setdefault("benches_skipped", []).append(name)
            continue
        try:
            summary[f"bench_{name}_s"] = sh(base + extra + [f"out={work / 'bench' / name}", *a.bench_set], room)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            log(f"bench {name} failed: {e}")
            summary.setdefault("benches_failed", []).append(name)
        bring_results_back(work, out, summary)


def bring_results_back(work: Path, out: Path, summary: dict) -> None:
    """Logs, metrics, records and bench JSON/PNG in one tarball, the summary and scaling record beside it."""
    write_json(work / "summary.json", summary)
    write_json(out / "summary.json", summary)
    if (work / "data_scaling.json").is_file() and summary["step"] == "train":  # (all: 8 files come back at most)
        write_bytes(out / "data_scaling.json", (work / "data_scaling.json").read_bytes())
    bench_files = [*sorted((work / "bench").glob("**/*.json")), *sorted((work / "bench").glob("**/*.png"))]
    tar_files(out / "results.tar.gz", work, [
        work / "head/log.jsonl", work / "head/metrics.json", work / "head/final/config.json",
        work / "data/prepare.json", work / "data/draft_vocab.safetensors", work / "summary.json",
        work / "data_scaling.json", work / "data_scaling.png", *bench_files])


def train_and_bench(a, work: Path, out: Path, data: Path, summary: dict) -> None:
    head = train(a, work, data, summary)
    metrics = json.loads((head / "metrics.json").read_text())
    summary["held_out"] = {k: v for k, v in metrics.items() if k.startswith("eval_") or k == "step"}
    record = scaling_record(head / "log.jsonl")
    if (data / "prepare.json").is_file():  # how much data there was (all of it, the held-out split included)
        prep = json.loads((data / "prepare.json").read_text())
        record["data"] = {k: prep.get(k) for k in ("conversations", "assistant_turns", "samples", "tokens")}
    write_scaling(record, work / "data_scaling.json")
    bring_head_back(head, out, summary)
    bring_results_back(work, out, summary)
    log(f"held-out tau_sim {metrics.get('eval_tau_sim', float('nan')):.3f}; head → {summary['head_files']}")
    bench(a, head, work, out, summary)


# ---- the command -----------------------------------------------------------------------------------
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", choices=("all", "regen", "train"), default="all")
    ap.add_argument("--out", required=True, help="the folder that comes back ($OUT)")
    ap.add_argument("--work", default="/root/ekwork")
    ap.add_argument("--budget-s", type=float, default=500, help="wall-clock seconds for this call")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the path with tiny sizes")
    g = ap.add_argument_group("regen")
    g.add_argument("--sharegpt", default=".dev/sharegpt/sharegpt.json.gz", help="the subset pack.sh wrote")
    g.add_argument("--batch", type=int, default=256)
    g.add_argument("--max-conversations", type=int, default=0, help="0: every conversation of --sharegpt")
    g.add_argument("--max-turns", type=int, default=2, help="user turns regenerated per conversation")
    g.add_argument("--new-tokens", type=int, default=256)
    g.add_argument("--max-prompt-tokens", type=int, default=512)
    g.add_argument("--regen-share", type=float, default=0.32, help="--step all: the budget's share for regen")
    g.add_argument("--finish-reserve-s", type=float, default=45, help="kept for the vocab and gzip after regen")
    g.add_argument("--max-gz-mib", type=float, default=20, help="cap on the gzipped JSONL (step 2 carries it)")
    g = ap.add_argument_group("train")
    g.add_argument("--regen-dir", default=".dev/regen", help="--step train: step 1's files, carried")
    g.add_argument("--train-config", default="configs/smollm2-135m-eagle3-gpu.yaml")
    g.add_argument("--train-set", nargs="*", default=[], help="extra key=value training overrides")
    g.add_argument("--bench-reserve-s", type=float, default=200, help="kept for the benches after training")
    g.add_argument("--min-train-minutes", type=float, default=1.0)
    g.add_argument("--train-slack-s", type=float, default=240, help="start-up, evaluation and save")
    g.add_argument("--eval-interval", type=int, default=0, help="0: --eval-points evaluations over the budget")
    g.add_argument("--eval-points", type=int, default=8)
    g.add_argument("--steps-per-s", type=float, default=10.0, help="expected training steps/s (H200: ~10.8)")
    g = ap.add_argument_group("bench")
    g.add_argument("--benches", default="main,batch,batch-large,t1", help="of main,batch,batch-large,t1,bf16")
    g.add_argument("--bench-prompts", type=int, default=8)
    g.add_argument("--bench-tokens", type=int, default=128)
    g.add_argument("--bench-repeats", type=int, default=1)
    g.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    g.add_argument("--batch-tokens", type=int, default=64)
    g.add_argument("--bench-min-s", type=float, default=40, help="a bench starts only with this much time left")
    g.add_argument("--bench-set", nargs="*", default=[], help="extra key=value bench overrides")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    start_clock()
    a = parse(argv)
    out, work = Path(a.out).resolve(), Path(a.work).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    summary: dict = {"step": a.step, "budget_s": a.budget_s, "device": a.device}
    t = time.perf_counter()  # convert the GGUF once (timed apart from the steps; a no-op once converted)
    assets.model_dir(TARGET)
    summary["convert_s"] = round(time.perf_counter() - t, 1)
    if a.step == "train":
        data = unpack_regen(Path(a.regen_dir).resolve(), work / "data")
    else:
        until = a.budget_s * (a.regen_share if a.step == "all" else 1.0)
        data = regenerate(a, work, until, summary)
        summary["prepare"] = finish_regen(a, data, out, summary)
        write_json(out / "summary.json", summary)
    if a.step != "regen":
        if a.step == "all":  # the vocab and counts travel in results.tar.gz: 8 files come back at most
            (out / "draft_vocab.safetensors").unlink(missing_ok=True)
            (out / "prepare.json").unlink(missing_ok=True)
        train_and_bench(a, work, out, data, summary)
    summary["wall_s"] = round(elapsed(), 1)
    write_json(out / "summary.json", summary)
    if a.step != "regen":
        bring_results_back(work, out, summary)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
