"""The GPU recipe for a lent device: regenerate ShareGPT with SmolLM2 → train EAGLE-3, P-EAGLE and DFlash
heads on the same data, each with the same budget → bench each.

Made for a lent GPU with a hard wall-clock budget, 64 MiB carried each way and no second try, in one call
(``--step all``) or two (``--step regen``, then ``--step train`` on the JSONL the first brought back):

* ``regen``: a one-batch probe, then regeneration until the budget's deadline (the run is killed there;
  regeneration appends whole batches and resumes, so only the batch in flight is lost), cut to what
  gzips into ``--max-gz-mib``; brings back ``regenerated.jsonl.gz`` (in parts if over 15 MiB),
  ``draft_vocab.safetensors`` and ``prepare.json`` (counts).
* ``train``: joins and unzips ``--regen-dir``'s JSONL, then for each of ``--kinds`` (default eagle3,
  peagle, dflash) trains one head, one after the other, with the same ``optim.max_minutes`` each (what the
  budget leaves after a bench reserve per kind, split evenly), from ``--train-config`` plus the kind's
  own head and loss keys (``KIND_SET``), evaluating held-out accuracy and τ_sim every ``eval_interval``
  steps (the data-scaling record). Then the benches on this device, most wanted first and every kind
  before the next bench (``tree="auto"``, plain, lookup, HF and HF lookup; plain and the head again with
  ``compile=true``; then the batch bench and T=1
  while time is left). ``summary.json`` holds per kind the held-out per-depth accuracy, τ_sim (all depths
  and the first ``--common-depths``) and per bench the decode τ, tokens/s, speedups and draft/verify ms.
  Brings back the heads of ``--bring-heads`` (``head-<kind>.tar``, in parts; at most 8 files come back)
  and ``results.tar.gz`` (logs, metrics, bench JSON/PNG, records of every kind).

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
    bench_summary,
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the recipes' own list, one copy
from bench_recipes import NO_EAGLE31

T0 = time.perf_counter()
TARGET = "smollm2-135m-instruct"
REGENERATED = "regenerated.jsonl"
# Each kind's head and loss keys over the shared --train-config (data, optimiser and budget stay the same):
# the shapes of configs/smollm2-135m-peagle.yaml and -dflash.yaml. loss.ttt_steps is the depths scored. The
# EAGLE-3 config's EAGLE 3.1 options are EAGLE-3's own: the parallel kinds refuse them, so they are turned off
# (NO_EAGLE31, bench_recipes' arm of that name).
KIND_SET = {
    "eagle3": [],
    "peagle": ["head.kind=peagle", "head.num_layers=2", "head.block_size=4", "loss.ttt_steps=4", *NO_EAGLE31],
    "dflash": ["head.kind=dflash", "head.num_layers=2", "head.block_size=8", "loss.ttt_steps=7", "loss.anchors=64",
               *NO_EAGLE31],
}


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


def kinds_of(a) -> list[str]:
    """``--kinds`` as a list; an unknown kind is refused before any work, naming it."""
    kinds = [k for k in a.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KIND_SET]
    if bad or not kinds:
        raise SystemExit(f"--kinds: {', '.join(bad) or 'none given'}; choose from {', '.join(KIND_SET)}")
    return kinds


def train_minutes(a, kinds: int) -> float:
    """Each kind's training budget: what is left after a bench reserve and ~45 s of start-up per kind,
    split evenly (every kind gets the same, whatever it costs per step)."""
    return max(a.min_train_minutes, (left(a) - kinds * (a.bench_reserve_s + 45)) / 60 / kinds)


def train(a, kind: str, minutes: float, work: Path, data: Path, record: dict) -> Path:
    """Train one ``kind`` head for ``minutes``; return its run folder (``work/heads/<kind>``)."""
    interval = a.eval_interval or max(1, int(a.steps_per_s * 60 * minutes / a.eval_points))
    record.update(train_budget_min=round(minutes, 2), eval_interval=interval)
    launch = [sys.executable, "-m", "accelerate.commands.launch", *(["--cpu"] if a.device == "cpu" else []),
              "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    vocab, run = data / "draft_vocab.safetensors", work / "heads" / kind
    cmd = launch + ["train_head.py", "--config", a.train_config, f"data.conversations={data / REGENERATED}",
                    *([f"data.draft_vocab={vocab}"] if vocab.is_file() else []), f"output_dir={run}",
                    f"optim.max_minutes={minutes:.2f}", f"eval_interval={interval}", "log_interval=1",
                    "save_interval=0", "trackers=[]", "progress=false", *KIND_SET[kind], *a.train_set]
    env = {**os.environ, **({"DS_ACCELERATOR": "cpu"} if a.device == "cpu" else {})}
    record["train_wall_s"] = sh(cmd, min(60 * minutes + a.train_slack_s, left(a) - 10), env=env)
    return run


def held_out(run: Path, common: int) -> dict:
    """The trainer's final held-out metrics, plus τ_sim over the first ``common`` depths (kinds that score
    different numbers of depths compare on those)."""
    from eaglekit.train.metrics import tau_sim  # torch: only where training ran

    metrics = json.loads((run / "metrics.json").read_text())
    out = {k: v for k, v in metrics.items() if k.startswith("eval_") or k == "step"}
    acc = [metrics[f"eval_acc_{k}"] for k in range(64) if f"eval_acc_{k}" in metrics]
    out[f"tau_sim_first_{common}"] = tau_sim(acc[:common])
    return out


def bring_head_back(kind: str, run: Path, out: Path, record: dict) -> None:
    """A kind's final head folder as one tar (weights barely compress), in parts under 16 MiB."""
    tarball = run / "final.tar"
    with tarfile.open(tarball, "w") as tar:
        tar.add(run / "final", arcname="final")
    record["head_files"] = write_parts(tarball.read_bytes(), out, f"head-{kind}.tar")
    tarball.unlink()


def bench_runs(a) -> dict[str, list[str]]:
    """The benches, most wanted first: T=0 with every baseline, the same with ``compile=true`` (plain and the
    head, compiled: CUDA graphs), the batch bench (small then large batches, so that the first fits even
    when the second does not), T=1."""
    sizes = [int(b) for b in a.batch_sizes.split(",") if b]
    small, large = [b for b in sizes if b <= 8], [b for b in sizes if b > 8]
    one = [f"prompts={a.bench_prompts}", "prompt_order=spread", f"max_new_tokens={a.bench_tokens}"]
    batch = ["temperatures=[0.0]", "prompt_order=spread", f"max_new_tokens={a.batch_tokens}"]
    runs = {"main": one + ["temperatures=[0.0]", "lookup_tokens=2,5,10"],
            "compiled": one + ["temperatures=[0.0]", "compile=true", "hf_baselines=false"],
            "batch": batch + [f"batch_sizes=[{','.join(map(str, small))}]", f"prompts={max(small or [1])}"],
            "batch-large": batch + [f"batch_sizes=[{','.join(map(str, large))}]", f"prompts={max(large or [1])}"],
            "t1": one + ["temperatures=[1.0]", "hf_baselines=false"],
            "bf16": one + ["temperatures=[0.0]", "dtype=bfloat16"]}
    if not small:
        runs.pop("batch")
    if not large:
        runs.pop("batch-large")
    return {name: runs[name] for name in a.benches.split(",") if name in runs}


def bench(a, kinds: list[str], work: Path, out: Path, summary: dict) -> None:
    """Every bench for every kind, a bench for all kinds before the next bench (so a budget cut keeps the
    comparison), each kind's decode numbers into its summary record."""
    for name, extra in bench_runs(a).items():
        for kind in kinds:
            record, room = summary["kinds"][kind], left(a) - 10
            if room < a.bench_min_s:
                log(f"skipping bench {name} of {kind}: {room:.0f}s left")
                record.setdefault("benches_skipped", []).append(name)
                continue
            folder = work / "bench" / kind / name
            cmd = [sys.executable, "-m", "eaglekit.cli", "bench", f"target={TARGET}",
                   f"head={work / 'heads' / kind / 'final'}", f"device={a.device}", "dtype=float32",
                   f"repeats={a.bench_repeats}", *extra, f"out={folder}", *a.bench_set]
            try:
                record[f"bench_{name}_s"] = sh(cmd, room)
                reports = sorted(folder.glob("*.json"))
                record.setdefault("bench", {})[name] = bench_summary(json.loads(reports[-1].read_text()))
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, IndexError) as e:
                log(f"bench {name} of {kind} failed: {e}")
                record.setdefault("benches_failed", []).append(name)
            bring_results_back(work, out, summary)


def bring_results_back(work: Path, out: Path, summary: dict) -> None:
    """Logs, metrics, records and bench JSON/PNG of every kind in one tarball; the summary and the first
    kind's scaling record beside it."""
    write_json(work / "summary.json", summary)
    write_json(out / "summary.json", summary)
    kinds = list(summary.get("kinds", {}))
    if kinds and (work / "scaling" / f"{kinds[0]}.json").is_file() and summary["step"] == "train":
        # (all: 8 files come back at most)
        write_bytes(out / "data_scaling.json", (work / "scaling" / f"{kinds[0]}.json").read_bytes())
    bench_files = [*sorted((work / "bench").glob("**/*.json")), *sorted((work / "bench").glob("**/*.png"))]
    per_kind = [work / "heads" / k / name for k in kinds for name in ("log.jsonl", "metrics.json", "final/config.json")]
    tar_files(out / "results.tar.gz", work, [
        *per_kind, work / "data/prepare.json", work / "data/draft_vocab.safetensors", work / "summary.json",
        *sorted((work / "scaling").glob("*")), *bench_files])


def train_and_bench(a, work: Path, out: Path, data: Path, summary: dict) -> None:
    """Train every kind (the same budget each), bring back what each left, then bench them all."""
    kinds = kinds_of(a)
    minutes = train_minutes(a, len(kinds))
    summary.update(kinds={k: {} for k in kinds}, train_budget_min_per_kind=round(minutes, 2))
    prep = json.loads((data / "prepare.json").read_text()) if (data / "prepare.json").is_file() else None
    for kind in kinds:
        record = summary["kinds"][kind]
        try:
            run = train(a, kind, minutes, work, data, record)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:  # the other kinds still run
            log(f"training {kind} failed: {e}")
            record["train_failed"] = str(e)
            continue
        record["held_out"] = held_out(run, a.common_depths)
        scaling = scaling_record(run / "log.jsonl")
        if prep:  # how much data there was (all of it, the held-out split included)
            scaling["data"] = {k: prep.get(k) for k in ("conversations", "assistant_turns", "samples", "tokens")}
        write_scaling(scaling, work / "scaling" / f"{kind}.json")
        if kind in a.bring_heads.split(","):
            bring_head_back(kind, run, out, record)
        bring_results_back(work, out, summary)
        log(f"{kind}: held-out tau_sim {record['held_out'].get('eval_tau_sim', float('nan')):.3f}")
    trained = [k for k in kinds if "held_out" in summary["kinds"][k]]
    bench(a, trained, work, out, summary)


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
    g.add_argument("--kinds", default="eagle3,peagle,dflash", help="head kinds trained one after the other, "
                   "the same budget each (of " + ",".join(KIND_SET) + ")")
    g.add_argument("--train-set", nargs="*", default=[], help="extra key=value training overrides (every kind)")
    g.add_argument("--common-depths", type=int, default=4, help="τ_sim over this many first depths, for every kind")
    g.add_argument("--bring-heads", default="eagle3", help="kinds whose head comes back (comma list; ~30 MiB each)")
    g.add_argument("--bench-reserve-s", type=float, default=70, help="kept per kind for the benches after training")
    g.add_argument("--min-train-minutes", type=float, default=1.0)
    g.add_argument("--train-slack-s", type=float, default=240, help="start-up, evaluation and save")
    g.add_argument("--eval-interval", type=int, default=0, help="0: --eval-points evaluations over the budget")
    g.add_argument("--eval-points", type=int, default=8)
    g.add_argument("--steps-per-s", type=float, default=10.0, help="expected training steps/s (H200: ~10.8)")
    g = ap.add_argument_group("bench")
    g.add_argument("--benches", default="main,compiled,batch,batch-large,t1",
                   help="of main,compiled,batch,batch-large,t1,bf16")
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
    kinds_of(a)  # a misspelt kind stops here, before any work
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
