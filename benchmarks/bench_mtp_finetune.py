"""Fine-tuning a shipped MTP layer vs training one from scratch, at equal tokens (issue #67).

No real MTP checkpoint is at hand offline, so the "shipped" layer is made here: stage 1 trains an MTP layer from
scratch (bench_mtp_vs_eagle3's ``mtp`` arm) on the first ``--stage1-samples`` training samples of a capture.
Stage 2 then trains, per seed and at equal tokens, on the other training samples (disjoint from stage 1's):

- ``scratch``: an MTP layer from scratch;
- ``finetune``: the same, started from stage 1's final layer (``head.init_from``);
- ``finetune_lr<lr>`` (``--finetune-lrs``): finetune at another learning rate.

Both are scored on the capture's last ``--eval-samples`` samples (never trained on in either stage), with
bench_recipes' per-sample scoring and paired bootstrap (``finetune - scratch``; and each against the stage-1
layer itself, ``shipped``). The config has no sample-range option, so the two stages read subset captures
(stage-1 + held-out, stage-2 + held-out) written here in eaglekit's own capture format under ``<out>``.

    python benchmarks/bench_mtp_finetune.py --features runs/mtp-vs-eagle3/features --out runs/mtp-finetune \\
        --set data.batch_size=2 --bf16 --threads 1 --parallel 2

Resumable: the subset captures, every trained run (bench_recipes) and every scoring are reused.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_mtp_vs_eagle3 as mve  # the sibling scripts, imported from their folder
import bench_recipes as br

from eaglekit.data_prep.capture import (
    MANIFEST,
    _write_shard,
    finalize,
    plan_hash,
    plan_shards,
    shard_name,
    shard_tensors,
)
from eaglekit.data_prep.dataset import FeatureDataset
from eaglekit.fileio import publish_dir, write_json


def subset_capture(src: Path, dst: Path, keep: list[int]) -> Path:
    """Samples ``keep`` of the capture ``src`` (in that order) as a capture of their own at ``dst``, shards and
    manifest as a capture writes them (plan hash of the kept samples; the draft vocabulary copied); written into a
    temporary folder and renamed, so ``dst`` exists only whole."""
    ds = FeatureDataset(src)
    old = ds.manifest
    ids = [old["sample_ids"][i] for i in keep]
    if (dst / MANIFEST).exists():
        have = json.loads((dst / MANIFEST).read_text())
        if have.get("complete") and have["sample_ids"] == ids and have["extra"].get("subset_of") == str(src):
            return dst
        raise SystemExit(f"{dst} holds another capture: delete it")
    items = [{k: v for k, v in ds[i].items() if k != "origin"} for i in keep]
    lengths = [len(it["input_ids"]) for it in items]
    ident = {"target": old["target"]["fingerprint"], "kind": old["kind"], "layer_ids": list(old["layer_ids"]),
             "shard_tokens": old["shard_tokens"]}
    plan = plan_shards(lengths, old["shard_tokens"])
    manifest = {**old, "num_samples": len(keep), "num_tokens": sum(lengths), "lengths": lengths, "sample_ids": ids,
                "plan_hash": plan_hash(items, ident), "complete": False,
                "shards": [{"file": shard_name(j), "first_sample": a, "num_samples": b - a,
                            "num_tokens": sum(lengths[a:b])} for j, (a, b) in enumerate(plan)],
                "extra": {**old.get("extra", {}), "subset_of": str(src), "subset_samples": keep}}
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for j, (a, b) in enumerate(plan):
        _write_shard(tmp / shard_name(j), shard_tensors(items[a:b]), manifest)
    for vocab in src.glob("draft_vocab*.safetensors"):
        shutil.copy2(vocab, tmp / vocab.name)
    write_json(tmp / MANIFEST, manifest, indent=1)
    finalize(tmp, manifest)
    return publish_dir(tmp, dst)


def run_stage(features: Path, out: Path, arms: list[str], seeds: list[int], tokens: int, a) -> dict:
    """bench_recipes on ``features`` (its last ``--eval-samples`` held out): train, score, report.json."""
    argv = ["--features", str(features), "--out", str(out), "--arms", *arms, "--reference", arms[0],
            "--seeds", *map(str, seeds), "--tokens", str(tokens), "--ttt", str(a.ttt),
            "--eval-samples", str(a.eval_samples), "--threads", str(a.threads), "--parallel", str(a.parallel),
            "--decode-questions", "0", *(["--bf16"] if a.bf16 else []),
            "--set", f"target.name={mve.TARGET}", *a.set]
    sys.argv = [sys.argv[0], *argv]
    br.main()
    return json.loads((out / "report.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", required=True, help="the capture (last --eval-samples held out)")
    ap.add_argument("--out", default="runs/mtp-finetune")
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--stage1-samples", type=int, default=34, help="first N training samples: stage 1's")
    ap.add_argument("--stage1-tokens", type=int, default=10000)
    ap.add_argument("--stage1-seed", type=int, default=0)
    ap.add_argument("--stage2-tokens", type=int, default=5500)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    ap.add_argument("--summary", default="benchmarks/results/cpu/mtp-finetune/summary.json")
    ap.add_argument("--finetune-lrs", nargs="*", type=float, default=[],
                    help="more finetune arms at these learning rates (arm finetune_lr<lr>; the config's is 1e-3)")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)  # the scoring, in this process
    t0, src, out = time.time(), Path(a.features), Path(a.out)
    n = json.loads((src / MANIFEST).read_text())["num_samples"]
    held = list(range(n - a.eval_samples, n))
    s1, s2 = list(range(a.stage1_samples)), list(range(a.stage1_samples, n - a.eval_samples))
    f1 = subset_capture(src, out / "features-stage1", s1 + held)
    f2 = subset_capture(src, out / "features-stage2", s2 + held)

    mve.add_arms(2816)  # br.ARMS["mtp"]: an MTP layer from scratch
    r1 = run_stage(f1, out / "stage1", ["mtp"], [a.stage1_seed], a.stage1_tokens, a)
    shipped = (out / "stage1" / f"mtp-s{a.stage1_seed}" / "final").resolve()
    br.ARMS["scratch"] = br.ARMS["mtp"]
    br.ARMS["finetune"] = [*br.ARMS["mtp"], f"head.init_from={shipped}"]
    tuned = ["finetune"]
    for lr in a.finetune_lrs:
        tuned.append(f"finetune_lr{lr:g}")
        br.ARMS[tuned[-1]] = [*br.ARMS["finetune"], f"optim.lr={lr:g}"]
    r2 = run_stage(f2, out / "stage2", ["scratch", *tuned], a.seeds, a.stage2_tokens, a)

    rows = {arm: {s: json.loads((out / "stage2" / f"{arm}-s{s}" / "per_sample.json").read_text()) for s in a.seeds}
            for arm in ("scratch", *tuned)}
    rows["shipped"] = {a.stage1_seed: json.loads((shipped.parent / "per_sample.json").read_text())}
    vs_shipped = br.compare(rows, "shipped")  # the same 32 held-out samples in the same order in both captures
    lengths = json.loads((src / MANIFEST).read_text())["lengths"]

    def run_info(report, arm, seed, per):
        return {"tau_sim": report["arms"][arm]["tau_sim_per_seed"][str(seed)], "acc_per_depth": mve.depth_acc(per),
                **report["runs"][f"{arm}-s{seed}"]}

    summary = {
        "issue": 67, "target": mve.TARGET, "features": str(src), "eaglekit": str(Path(br.__file__).parents[1]),
        "data": {"samples": n, "held_out": {"samples": [held[0], held[-1]], "tokens": sum(lengths[i] for i in held)},
                 "stage1": {"samples": [s1[0], s1[-1]], "tokens": sum(lengths[i] for i in s1)},
                 "stage2": {"samples": [s2[0], s2[-1]], "tokens": sum(lengths[i] for i in s2)},
                 "held_out_positions_per_depth": [sum(r["total"][k] for r in rows["shipped"][a.stage1_seed])
                                                  for k in range(a.ttt)]},
        "budget": {"stage1": {"tokens_target": a.stage1_tokens, "steps": r1["steps"], "epochs": r1["epochs"],
                              "seed": a.stage1_seed},
                   "stage2": {"tokens_target": a.stage2_tokens, "steps": r2["steps"], "epochs": r2["epochs"],
                              "seeds": a.seeds},
                   "ttt": a.ttt, "bf16_autocast": a.bf16, "threads": a.threads, "parallel": a.parallel, "set": a.set,
                   "config": str(br.CONFIG.relative_to(br.ROOT)), "arm_overrides": br.ARMS["mtp"]},
        "shipped_stage1": {"tau_sim": r1["arms"]["mtp"]["tau_sim"], "tau_chain": r1["arms"]["mtp"]["tau_chain"],
                           **run_info(r1, "mtp", a.stage1_seed, rows["shipped"][a.stage1_seed])},
        "arms": {arm: {"tau_sim": r2["arms"][arm]["tau_sim"], "tau_chain": r2["arms"][arm]["tau_chain"],
                       "per_seed": {str(s): run_info(r2, arm, s, rows[arm][s]) for s in a.seeds}}
                 for arm in ("scratch", *tuned)},
        **{f"diff_{arm}_minus_scratch": {k: r2["arms"][arm][k] for k in ("tau_sim_diff", "tau_sim_ci95",
                                                                        "tau_chain_diff", "tau_chain_ci95")}
           for arm in tuned},
        **{f"diff_{arm}_minus_shipped": {"tau_sim": vs_shipped[arm]["tau_sim_diff"],
                                         "tau_sim_ci95": vs_shipped[arm]["tau_sim_ci95"]}
           for arm in (*tuned, "scratch")},
        "bootstrap": "paired over the held-out samples, 10000 draws, arm value = mean over its seeds",
        "script_wall_seconds": time.time() - t0,
        "reports": [str(out / "stage1" / "report.json"), str(out / "stage2" / "report.json")],
    }
    write_json(Path(a.summary), summary, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
