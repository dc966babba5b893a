"""MTP layer vs EAGLE-3 head at equal training tokens and about equal parameters (issue #67).

An MTP-style layer trained from scratch (``head.kind=mtp``: transformers' ``MtpLayer`` around the target's own
decoder-layer class; reads the target's last hidden state, drafts over the full vocabulary through the target's
lm_head) against an EAGLE-3 head shrunk to the same trainable parameter count (``head.intermediate_size``, and the
capture's draft vocabulary), on one EAGLE-3 capture (its ``last`` serves the MTP arm, its taps the EAGLE-3 arm).

This is benchmarks/bench_recipes.py with two arms added: the same training runs (equal optimizer steps, same
samples in the same order per seed, resumable), the same per-held-out-sample scoring and the same paired bootstrap
(``compare``; the reference is ``eagle3``, so ``tau_sim_diff`` is MTP - EAGLE-3). It then adds what the comparison
needs beside it: each arm's trainable parameter count, per-seed accuracy per depth, the data size, and writes a
``summary.json``.

    eaglekit prepare --config configs/prepare-qwen2.5-coder-0.5b.yaml output_dir=runs/mtp-vs-eagle3/features \\
        num_conversations=128 max_turns=1 max_length=384 draft_vocab_size=4096 shard_mb=256 batch_tokens=4096 \\
        regenerate.enabled=true regenerate.max_new_tokens=128 regenerate.batch_size=8 regenerate.max_prompt_tokens=256
    python benchmarks/bench_mtp_vs_eagle3.py --features runs/mtp-vs-eagle3/features --out runs/mtp-vs-eagle3 \\
        --seeds 0 1 --tokens 30000 --bf16 --summary benchmarks/results/cpu/mtp-vs-eagle3/summary.json

Any other bench_recipes.py option passes through (``--ttt``, ``--eval-samples``, ``--threads``, ``--parallel``,
``--decode-questions``, ``--set``). ``--eagle3-intermediate`` sets the EAGLE-3 arm's MLP width (default 2816: with
``--eagle3-draft-vocab`` 4096, the default, 16,521,344 trainable parameters against the MTP layer's 16,520,704 on
Qwen2.5-Coder-0.5B).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_recipes as br  # the sibling script, imported from its folder

from eaglekit.fileio import write_json

TARGET = "qwen2.5-coder-0.5b-instruct"


def add_arms(intermediate: int, draft_vocab: int = 4096) -> None:
    # EAGLE 3.1's fc_norm / norm_output are EAGLE-3 options: the MTP layer has its own norms (enorm, hnorm,
    # shared_head.norm); no shipped MTP layer to start from (Qwen2.5 ships none), so from scratch
    br.ARMS["mtp"] = [*br.NO_EAGLE31, "head.kind=mtp", "head.init_from_target=false"]
    # the draft vocabulary is the config's (bench_recipes' recipe: 8192), rebuilt from the capture's counts: set it
    br.ARMS["eagle3"] = [f"head.intermediate_size={intermediate}", f"head.draft_vocab_size={draft_vocab}"]


def param_counts(arms: list[str], a) -> dict:
    """Trainable parameters of each arm's head as training builds it (``assemble``: the capture's draft vocabulary),
    read back from its first seed's trained head."""
    from eaglekit.train.build import assemble
    from eaglekit.train.config import load_train_config

    out = {}
    for arm in arms:
        cfg = load_train_config(br.CONFIG, [*br.common(a), *br.ARMS[arm], "eval_only=true",
                                            f"head.init_from={Path(a.out) / f'{arm}-s{a.seeds[0]}' / 'final'}",
                                            f"output_dir={Path(a.out) / 'params' / arm}"])
        parts = assemble(cfg)
        try:
            head = parts.head
            out[arm] = {"trainable": sum(p.numel() for p in head.parameters() if p.requires_grad),
                        "total_in_head": sum(p.numel() for p in head.parameters()),
                        "draft_vocab_size": getattr(head.config, "draft_vocab_size", None),
                        "reads": head.reads}
        finally:
            parts.lock.release()
    return out


def depth_acc(rows: list[dict]) -> list[float]:
    K = len(rows[0]["total"])
    return [sum(r["correct"][k] for r in rows) / max(1, sum(r["total"][k] for r in rows)) for k in range(K)]


def main() -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--summary", default="benchmarks/results/cpu/mtp-vs-eagle3/summary.json")
    ap.add_argument("--eagle3-intermediate", type=int, default=2816)
    ap.add_argument("--eagle3-draft-vocab", type=int, default=4096)
    own, rest = ap.parse_known_args()
    add_arms(own.eagle3_intermediate, own.eagle3_draft_vocab)
    # the target, the two arms and the reference unless given; no decoding unless asked (minutes per head on a CPU)
    argv = list(rest)
    if "--arms" not in argv:
        argv += ["--arms", "mtp", "eagle3"]
    if "--reference" not in argv:
        argv += ["--reference", "eagle3"]
    if "--decode-questions" not in argv:
        argv += ["--decode-questions", "0"]
    if "--set" in argv:
        i = argv.index("--set")
        argv.insert(i + 1, f"target.name={TARGET}")
    else:
        argv += ["--set", f"target.name={TARGET}"]
    sys.argv = [sys.argv[0], *argv]
    t0 = time.time()
    br.main()  # trains (or reuses) every run, scores it per held-out sample, writes <out>/report.json
    summarize(argv, own.summary, time.time() - t0)


def summarize(argv: list[str], path: str, wall: float) -> None:
    # the same parsed options bench_recipes saw, for the parameter count and the summary
    a = argparse.Namespace(**vars(parse_recipes_args(argv)))
    report = json.loads((Path(a.out) / "report.json").read_text())
    manifest = json.loads((Path(a.features) / "manifest.json").read_text())
    lengths = manifest["lengths"]
    n_eval = a.eval_samples
    per_seed = {}
    for arm in a.arms:
        for seed in a.seeds:
            rows = json.loads((Path(a.out) / f"{arm}-s{seed}" / "per_sample.json").read_text())
            per_seed.setdefault(arm, {})[str(seed)] = {
                "tau_sim": report["arms"][arm]["tau_sim_per_seed"][str(seed)]
                if str(seed) in report["arms"][arm]["tau_sim_per_seed"] else report["arms"][arm]["tau_sim_per_seed"][seed],
                "acc_per_depth": depth_acc(rows),
                "held_out_positions_per_depth": [sum(r["total"][k] for r in rows) for k in range(len(rows[0]["total"]))],
                **report["runs"][f"{arm}-s{seed}"],
            }
    mtp = report["arms"]["mtp"]
    summary = {
        "issue": 67,
        "target": TARGET,
        "features": str(a.features),
        "data": {"samples": len(lengths), "tokens": sum(lengths), "train_samples": len(lengths) - n_eval,
                 "train_tokens": sum(lengths[:-n_eval]), "held_out_samples": n_eval,
                 "held_out_tokens": sum(lengths[-n_eval:]), "longest_sample": max(lengths), "extra": manifest.get("extra")},
        # minutes > 0: equal time (each run's training stopped after that many minutes; steps set only the warm-up)
        "budget": {"minutes": a.minutes, "tokens_target": a.tokens, "steps": report["steps"], "epochs": report["epochs"],
                   "ttt": a.ttt,
                   "bf16_autocast": a.bf16, "threads": a.threads, "parallel": a.parallel},
        "params": param_counts(list(a.arms), a),
        "arms": {arm: {"tau_sim": report["arms"][arm]["tau_sim"], "tau_chain": report["arms"][arm].get("tau_chain"),
                       "per_seed": per_seed[arm]} for arm in a.arms},
        "diff_mtp_minus_eagle3": {"tau_sim": mtp["tau_sim_diff"], "tau_sim_ci95": mtp["tau_sim_ci95"],
                                  "tau_chain": mtp.get("tau_chain_diff"), "tau_chain_ci95": mtp.get("tau_chain_ci95"),
                                  "bootstrap": "paired over held-out samples, 10000 draws, arm value = mean over seeds"},
        "script_wall_seconds": wall,
        "report": str(Path(a.out) / "report.json"),
    }
    p = summary["params"]
    summary["params"]["eagle3_over_mtp"] = p["eagle3"]["trainable"] / p["mtp"]["trainable"]
    write_json(Path(path), summary, indent=1)
    print(json.dumps(summary, indent=1))


def parse_recipes_args(argv: list[str]) -> argparse.Namespace:
    """bench_recipes' own options (its parser is inside its main(): rebuilt here from the same argv)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--features", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--arms", nargs="+")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--tokens", type=int, default=500_000)
    ap.add_argument("--minutes", type=float, default=0)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--arm-features", nargs="*", default=[])
    ap.add_argument("--set", nargs="*", default=[])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--decode-questions", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--reference", default="eagle3")
    ap.add_argument("--train-only", action="store_true")
    return ap.parse_args(argv)


if __name__ == "__main__":
    main()
