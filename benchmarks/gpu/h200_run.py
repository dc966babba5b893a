"""One GPU session, one command: regenerate ShareGPT with SmolLM2 → train an EAGLE-3 head → decode bench.

Made for a lent H200 with a hard wall-clock budget and no second try: every phase gets a share of
``--budget-s`` measured as it goes (regeneration is sized from a one-batch probe, training gets
``optim.max_minutes``), and every result is copied under ``--out`` as soon as it exists, so a run cut
short still returns what it finished. Run by ``benchmarks/gpu/run.sh``; results go to RESULTS.md.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def sh(cmd: list[str], timeout: float) -> float:
    """Run a command (output to our stdout), raise on failure; return its wall time."""
    print(f"\n[{elapsed():6.0f}s] $ {' '.join(cmd)}", flush=True)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=max(timeout, 1))
    return time.perf_counter() - t


def pack_small(out: Path, work: Path) -> None:
    """Logs, metrics and bench JSON/PNG in one tarball (the transfer back takes few files)."""
    tmp = out / "small.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for p in [work / "head/log.jsonl", work / "head/metrics.json", work / "data/prepare.json",
                  *sorted((work / "bench").glob("**/*.json")), *sorted((work / "bench").glob("**/*.png")),
                  *sorted(work.glob("*.json"))]:
            if p.exists():
                tar.add(p, arcname=str(p.relative_to(work)))
    os.replace(tmp, out / "small.tar.gz")


def split_copy(src: Path, out: Path, name: str, part_mb: int = 15) -> None:
    data = src.read_bytes()
    step = part_mb << 20
    for i in range(0, len(data), step):
        (out / f"{name}.part{i // step}").write_bytes(data[i:i + step])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/root/ekwork")
    ap.add_argument("--budget-s", type=float, default=500)
    ap.add_argument("--regen-share", type=float, default=0.32, help="share of the budget for regeneration")
    ap.add_argument("--bench-reserve-s", type=float, default=150)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--max-conversations", type=int, default=8000)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script with tiny sizes")
    ap.add_argument("--bench-prompts", type=int, default=6)
    ap.add_argument("--bench-tokens", type=int, default=192)
    ap.add_argument("--train-set", nargs="*", default=[], help="extra key=value training overrides")
    a = ap.parse_args()
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    summary: dict = {"budget_s": a.budget_s}

    # 0. convert the GGUF once (timed apart from regeneration)
    summary["convert_s"] = sh([py, "-c", "from eaglekit import assets; print(assets.model_dir('smollm2-135m-instruct'))"],
                              120)

    # 1. regeneration: a one-batch probe, then as many batches as the share allows (prepare resumes)
    data = work / "data"
    prep = [py, "-m", "eaglekit.cli", "prepare", "--config", "configs/prepare-smollm2.yaml", f"output_dir={data}",
            "max_turns=1", "capture=false", "draft_vocab_size=8192", "regenerate.enabled=true",
            f"regenerate.max_new_tokens={a.new_tokens}", "regenerate.max_prompt_tokens=512",
            f"regenerate.batch_size={a.batch}", f"device={a.device}", "dtype=float32"]
    probe = sh(prep + [f"num_conversations={a.batch}"], 200)
    batches = int((a.regen_share * a.budget_s - probe) // probe)
    n = min(a.max_conversations, a.batch * (1 + max(0, batches)))
    summary.update(regen_probe_s=probe, conversations=n)
    if n > a.batch:
        summary["regen_s"] = probe + sh(prep + [f"num_conversations={n}"], a.budget_s - elapsed() - 60)
    with open(data / "regenerated.jsonl", "rb") as src, gzip.open(out / "regenerated.jsonl.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    pack_small(out, work)

    # 2. training with what is left minus the bench reserve
    minutes = max(1.0, (a.budget_s - elapsed() - a.bench_reserve_s - 45) / 60)
    summary["train_budget_min"] = minutes
    accelerate = [py, "-m", "accelerate.commands.launch", *(["--cpu"] if a.device == "cpu" else []),
                  "--num_processes", "1", "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no"]
    summary["train_wall_s"] = sh(accelerate + ["train_head.py", "--config", "configs/smollm2-135m-eagle3-gpu.yaml",
                                  f"data.conversations={data / 'regenerated.jsonl'}",
                                  f"data.draft_vocab={data / 'draft_vocab.safetensors'}", f"output_dir={work / 'head'}",
                                  f"optim.max_minutes={minutes:.2f}", "progress=false", *a.train_set],
                                 60 * minutes + 240)
    head = work / "head" / "final"
    split_copy(head / "model.safetensors", out, "head.safetensors")
    shutil.copy(head / "config.json", out / "head_config.json")
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    pack_small(out, work)

    # 3. decode benches on this GPU, most wanted first; each bounded by the time left
    bench = [py, "-m", "eaglekit.cli", "bench", "target=smollm2-135m-instruct", f"head={head}", f"device={a.device}",
             f"prompts={a.bench_prompts}", f"max_new_tokens={a.bench_tokens}", "repeats=1"]
    runs = [("bf16", ["dtype=bfloat16", "temperatures=[0.0]", "lookup_tokens=2,5,10"]),
            ("fp32", ["dtype=float32", "temperatures=[0.0,1.0]", "hf_baselines=false"])]
    for name, extra in runs:
        left = a.budget_s - elapsed() - 10
        if left < 40:
            print(f"skipping bench {name}: {left:.0f}s left", flush=True)
            continue
        try:
            summary[f"bench_{name}_s"] = sh(bench + extra + [f"out={work / 'bench' / name}"], left)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            print(f"bench {name} failed: {e}", flush=True)
        (work / "summary.json").write_text(json.dumps(summary, indent=1))
        pack_small(out, work)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
