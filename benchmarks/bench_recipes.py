"""Sample efficiency: published training ideas against today's EAGLE-3 recipe at equal tokens.

Each arm trains one head per seed on the same captured features (same samples, same order per seed, same
number of optimizer steps), then every head is scored per held-out sample (the ``data.eval_samples`` the
trainer never sees). The comparison is paired: a bootstrap over held-out samples resamples the same
samples for every arm, and an arm's τ_sim is the mean over its seeds. Arms:

- ``base``: today's recipe (configs/smollm2-135m-eagle3-long.yaml: soft CE against the target over the
  draft vocabulary, TTT with the head's own earlier features — HASS's harmonized context alignment is
  already part of it — and EAGLE 3.1's ``head.fc_norm`` / ``head.norm_output``, the default since they won
  this grid; before that, the grid's ``eagle31`` arm was today's ``base`` and its ``base`` today's ``no_eagle31``);
- ``topk``: HASS's harmonized objective distillation, + ``loss.topk_weight`` × CE over the teacher's top-K;
- ``layer``: the decoder layer started from the target's last layer (``head.init_layer_from_target``);
- ``lk``, ``lk_alpha``, ``lk_tv``: the LK losses (arXiv 2602.23881) instead of the soft CE
  (``loss.objective``; docs/training.md "Training objectives"), the acceptance of sampling;
  ``lk_greedy``: ``lk`` against the teacher's argmax (``loss.lk_acceptance=greedy``, what greedy
  verification and τ_sim count);
- ``no_eagle31``: the recipe without EAGLE 3.1's head options (plain EAGLE-3);
  ``lk_no_eagle31``: that with ``lk``;
- ``norm_before_fc``: one RMSNorm over the concatenated taps, without EAGLE 3.1 (the head llama.cpp serves);
- ``dflash``, ``dspark``, ``dflash_dpace``, ``dflash_mask``, ``dflash2``, ``dflash2_drop``, ``peagle``,
  ``peagle_embed``: the parallel drafters on the same capture (compare each against its own backbone with
  ``--reference``);
  ``peagle_cod`` (COD sampling, r 0.8, floor 0.2), ``peagle_new`` (that with 4 layers), ``dflash_norm``
  (normalised depth weights), ``dflash_new`` (5 layers, block 16, gamma 7, 512 anchors, normalised, learned
  mask vector): the published recipes of configs/llama-3.1-8b-{peagle,dflash}.yaml on this capture's taps,
  and their parts — compare them at equal time (``--minutes``): their point is work per token;
- ``fp8``: ``base`` trained on the same capture stored in fp8 (``--arm-features fp8=DIR``, a directory
  ``eaglekit.data_prep.capture.convert_features`` wrote); every arm is scored on ``--features``.

    eaglekit prepare --config configs/prepare-smollm2.yaml output_dir=runs/recipes/features \\
        num_conversations=1100 max_length=768 draft_vocab_size=8192
    python benchmarks/bench_recipes.py --features runs/recipes/features --out runs/recipes \\
        --seeds 0 1 --tokens 500000                      # base, lk, no_eagle31
    python benchmarks/bench_recipes.py ... --arms lk_alpha lk_greedy topk   # any other arms, base added

Then each head decodes the first ``--decode-questions`` MT-bench questions greedily (a chain of ``--ttt``
drafted tokens per verify step): τ per verify step, mean over the arm's seeds, beside τ_sim.

``--minutes M`` gives every run M minutes of training instead of equal tokens (its cosine follows the time;
run nothing else beside it: the runs share the machine).

Finished runs (``<out>/<arm>-s<seed>/final``) are reused and a killed run resumes from its last checkpoint
(one every ~10% of the run), so an interrupted experiment resumes.
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

from eaglekit.bench.report import paired_bootstrap
from eaglekit.fileio import write_json

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/smollm2-135m-eagle3-long.yaml"
NO_EAGLE31 = ["head.fc_norm=false", "head.norm_output=false"]
ARMS = {
    "base": [],
    "topk": ["loss.topk=10", "loss.topk_weight=1.0"],
    "layer": ["head.init_layer_from_target=true"],
    "lk": ["loss.objective=lk"],
    "lk_alpha": ["loss.objective=lk_alpha"],
    "lk_tv": ["loss.objective=lk_tv"],
    "lk_greedy": ["loss.objective=lk", "loss.lk_acceptance=greedy"],
    "no_eagle31": NO_EAGLE31,
    "lk_no_eagle31": ["loss.objective=lk", *NO_EAGLE31],
    "norm_before_fc": [*NO_EAGLE31, "head.norm_before_fc=true"],  # what llama.cpp serves, vs per-tap fc_norm
    "fp8": [],  # the recipe, trained on fp8-stored features (--arm-features fp8=DIR)
    # the parallel drafters on the same capture, a block of ttt + 1 (--set head.block_size=N to change it):
    # DSpark against its own backbone with --reference dflash (compare tau_chain: per-depth accuracy is
    # teacher-forced, and DSpark's bias reads the true previous token)
    "dflash": [*NO_EAGLE31, "head.kind=dflash", "head.num_layers=2"],
    "dspark": [*NO_EAGLE31, "head.kind=dspark", "head.num_layers=2", "head.markov_rank=64"],
    "dflash_dpace": [*NO_EAGLE31, "head.kind=dflash", "head.num_layers=2", "loss.block_weighting=dpace"],
    "dflash_mask": [*NO_EAGLE31, "head.kind=dflash", "head.num_layers=2", "head.mask_embedding=true"],
    # DFlash 2 (its convolution and selector, the published K 16, r 256) against --reference dflash: both need
    # a capture over the full vocabulary (prepare ... draft_vocab_size=<V>: DFlash 2 takes no other)
    "dflash2": [*NO_EAGLE31, "head.kind=dflash2", "head.num_layers=2"],
    "dflash2_drop": [*NO_EAGLE31, "head.kind=dflash2", "head.num_layers=2", "loss.selector_missing=drop"],
    # P-EAGLE with its embedding frozen (the target's) or trained (head.train_embedding; --reference peagle)
    "peagle": [*NO_EAGLE31, "head.kind=peagle", "head.num_layers=2"],
    "peagle_embed": [*NO_EAGLE31, "head.kind=peagle", "head.num_layers=2", "head.train_embedding=true"],
    # the published recipes (configs/llama-3.1-8b-{peagle,dflash}.yaml) at this capture's taps, and their parts
    "peagle_cod": [*NO_EAGLE31, "head.kind=peagle", "head.num_layers=2", "loss.cod_ratio=0.8", "loss.cod_floor=0.2"],
    "peagle_new": [*NO_EAGLE31, "head.kind=peagle", "head.num_layers=4", "loss.cod_ratio=0.8", "loss.cod_floor=0.2"],
    "dflash_norm": [*NO_EAGLE31, "head.kind=dflash", "head.num_layers=2", "loss.block_weights_normalized=true"],
    "dflash_new": [*NO_EAGLE31, "head.kind=dflash", "head.num_layers=5", "head.block_size=16", "loss.anchors=512",
                   "loss.block_weights_normalized=true", "head.mask_embedding=true"],
}
# the default --arms: the recipe (EAGLE 3.1 on since the LK / EAGLE 3.1 grid), LK on it, and the recipe without
# EAGLE 3.1 (EAGLE-3 as before, to re-check the adoption on new data); `topk`, `layer`: earlier ideas
GRID = ["base", "lk", "no_eagle31"]


def common(a) -> list[str]:
    return [f"data.features_dir={a.features}", "data.conversations=null", f"loss.ttt_steps={a.ttt}",
            f"data.eval_samples={a.eval_samples}", f"optim.bf16={str(a.bf16).lower()}",
            "trackers=[]", "progress=false", *a.set]


def steps_for(a) -> tuple[int, int]:
    """Optimizer steps whose micro-batches (length-bucketed, as the trainer plans them) hold >= ``tokens``, and
    the epochs they need: a capture with fewer training tokens than ``tokens`` is read several times (every arm
    sees the same samples in the same order, so the comparison stays paired; the report says how many)."""
    from eaglekit.train.config import load_train_config

    batch = load_train_config(CONFIG, common(a)).data.batch_size  # the runs' own micro-batch size
    features, tokens = a.features, a.tokens
    manifest = json.loads((Path(features) / "manifest.json").read_text())
    lengths = manifest["lengths"][:-a.eval_samples]
    mean = sum(lengths) / len(lengths)
    steps = -(-int(1.05 * tokens) // int(mean * batch))  # 5% over: micro-batches vary in length
    return steps, -(-steps * batch // len(lengths))


def budget(a, steps: int, epochs: int) -> list[str]:
    """Equal tokens (``steps`` for every arm), or under ``--minutes`` equal time: each run stops after that
    many minutes of training, its cosine following the time spent (``optim.max_minutes``); ``steps`` (from
    ``--tokens``, a guess of what the fastest arm reaches) then only sets the warm-up."""
    if not a.minutes:
        return [f"optim.max_steps={steps}", f"optim.warmup_steps={max(1, steps // 10)}", f"optim.epochs={epochs}",
                f"save_interval={max(1, steps // 10)}"]
    return [f"optim.max_minutes={a.minutes}", f"optim.max_steps={100 * steps}", f"optim.epochs={100 * epochs}",
            f"optim.warmup_steps={max(1, steps // 10)}", f"save_interval={max(1, steps // 10)}"]


def train(arm: str, seed: int, a, steps: int, epochs: int) -> Path:
    out = Path(a.out) / f"{arm}-s{seed}"
    if (out / "final").is_dir():
        return out / "final"
    device = [] if torch.cuda.is_available() else ["--cpu"]  # on a GPU the same command takes minutes
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *device, "--num_processes", "1", "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "train_head.py"),
           "--config", str(CONFIG), *common(a), f"output_dir={out}", f"seed={seed}",
           # a checkpoint every ~10% of the run: a run killed midway resumes (resume=auto) instead of restarting
           *budget(a, steps, epochs), "eval_interval=0", "keep_last=1", *ARMS[arm], *arm_features(a, arm)]
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{arm}-s{seed}.log", "a") as log:  # appended: a resumed run keeps its first part
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT,
                       env={**os.environ, "OMP_NUM_THREADS": str(a.threads)})
    print(f"{arm} seed {seed}: trained in {time.time() - t0:.0f} s", flush=True)
    return out / "final"


def arm_features(a, arm: str) -> list[str]:
    """The override that trains ``arm`` on its own copy of the samples (``--arm-features ARM=DIR``), if any."""
    own = dict(x.split("=", 1) for x in a.arm_features).get(arm)
    if own is None and arm == "fp8":
        raise SystemExit("arm fp8 trains on a fp8 copy of --features: give --arm-features fp8=DIR")
    return [] if own is None else [f"data.features_dir={own}"]


def training_record(run: Path) -> dict:
    """Training tokens and seconds of a run, from its log.jsonl."""
    recs = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    last = recs[-1]
    return {"tokens": sum(r.get("tokens", 0) for r in recs if "loss" in r and not r.get("final")),
            "seconds": last.get("train_seconds"), "train_eval_tau_sim": last.get("eval_tau_sim")}


@torch.no_grad()
def per_sample(head_dir: Path, a, arm: str) -> list[dict]:
    """Per held-out sample: supervised positions and top-1 hits per TTT step (under the arm's own settings:
    head.init_from refuses a head whose options, e.g. EAGLE 3.1's, differ from the config's)."""
    from eaglekit.heads.objectives import TTTModel
    from eaglekit.train.build import assemble
    from eaglekit.train.config import load_train_config
    from eaglekit.train.data import collate, fetch_with_top, tensors_to

    cfg = load_train_config(CONFIG, [*common(a), *ARMS[arm], f"head.init_from={head_dir}", "eval_only=true",
                                     f"output_dir={head_dir.parent / 'eval'}"])
    parts = assemble(cfg)
    try:
        model = TTTModel(parts.head, parts.teacher, cfg.loss).eval()
        rows, dev = [], parts.acc.device
        for i in range(len(parts.sources.eval)):
            items = fetch_with_top(parts.sources.eval, [i], parts.teacher, cfg.loss.chunk_tokens, dev)
            _, st = model(**tensors_to(collate(items, parts.head.reads), dev), steps=a.ttt, train=False)
            rows.append({"correct": st.correct, "total": st.total, "chain": st.chain})
        return rows
    finally:
        parts.lock.release()


@torch.no_grad()
def decode_tau(target, head, prompts: list, depth: int, max_new_tokens: int) -> dict:
    """Greedy decoding of ``prompts`` with a chain of ``depth`` drafts per step: τ = emitted tokens per
    verify forward over all of them (the prompts' steps pooled), and per prompt."""
    from eaglekit import decode
    from eaglekit.decode.drafters import TreeSpec

    chain = TreeSpec(depth=depth, top_k=1, total_tokens=depth)
    lengths, per_prompt = [], []
    for ids in prompts:
        out = decode.generate(target, head, ids, max_new_tokens=max_new_tokens, tree=chain)
        lengths += out.stats.accept_lengths
        per_prompt.append(out.stats.tau)
    return {"tau": sum(lengths) / len(lengths), "per_prompt": per_prompt, "steps": len(lengths)}


def decode_all(heads: dict, a) -> dict:
    """``decode_tau`` of every head on the first ``a.decode_questions`` MT-bench questions (cached per head)."""
    from eaglekit import assets
    from eaglekit.export import load_head
    from eaglekit.target import load_target
    from eaglekit.train.config import load_train_config

    target = load_target(load_train_config(CONFIG, common(a)).target.name)  # the runs' own target
    prompts = [target.chat_ids(q["turns"][0]) for q in assets.load_mt_bench()[:a.decode_questions]]
    out = {}
    for (arm, seed), head_dir in heads.items():
        cached = head_dir.parent / f"decode-{a.decode_questions}q-{a.decode_tokens}t.json"
        if not cached.exists():
            write_json(cached, decode_tau(target, load_head(head_dir, target), prompts, a.ttt, a.decode_tokens))
        out.setdefault(arm, {})[seed] = json.loads(cached.read_text())["tau"]
    return {arm: {"tau": sum(t.values()) / len(t), "per_seed": t} for arm, t in out.items()}


def tau_sim(rows: list[dict], idx: list[int]) -> float:
    from eaglekit.train.metrics import tau_sim as tau

    K = len(rows[0]["total"])
    return tau([sum(rows[i]["correct"][k] for i in idx) / max(1, sum(rows[i]["total"][k] for i in idx))
                for k in range(K)])


def tau_chain(rows: list[dict], idx: list[int]) -> float:
    """1 + sum over depths of the share of positions whose depths 1..k were all right: what a chain accepts
    (for a parallel head the fair one, its per-depth accuracy being teacher-forced)."""
    K = len(rows[0]["total"])
    return 1 + sum(sum(rows[i]["chain"][k] for i in idx) / max(1, sum(rows[i]["total"][k] for i in idx))
                   for k in range(K))


def compare(scores: dict, ref: str = "base", n_boot: int = 10000, seed: int = 0) -> dict:
    """Each arm vs ``ref``: τ_sim and τ_chain (means over seeds), the differences and their paired-bootstrap
    95% CIs (held-out samples resampled, the same draw for both arms)."""
    n = len(next(iter(scores[ref].values())))
    every = list(range(n))
    metrics = {"tau_sim": tau_sim, "tau_chain": tau_chain}

    def arm_value(metric, arm, idx):
        return sum(metrics[metric](rows, idx) for rows in scores[arm].values()) / len(scores[arm])

    has_chain = all("chain" in runs[s][0] for runs in scores.values() for s in runs)
    out = {}
    for arm, runs in scores.items():
        out[arm] = {}
        for metric in metrics if has_chain else ["tau_sim"]:
            value = arm_value(metric, arm, every)
            out[arm][metric] = value
            out[arm][f"{metric}_per_seed"] = {s: metrics[metric](r, every) for s, r in runs.items()}
            if arm == ref:
                continue
            d, lo, hi = paired_bootstrap(lambda idx, m=metric, arm=arm: arm_value(m, arm, idx) - arm_value(m, ref, idx),
                                         n, n_boot, seed)
            base = arm_value(metric, ref, every)
            out[arm][f"{metric}_diff"], out[arm][f"{metric}_ci95"] = d, [lo, hi]
            out[arm][f"{metric}_gain_pct_of_tau_minus_1"] = 100 * d / (base - 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", required=True, help="an `eaglekit prepare` capture directory (EAGLE-3 taps)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--arms", nargs="+", default=list(GRID), choices=list(ARMS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--tokens", type=int, default=500_000, help="training tokens per run (at least)")
    ap.add_argument("--minutes", type=float, default=0,
                    help="equal time instead of equal tokens: minutes of training per run (run them with nothing "
                         "else on the machine; --tokens then only sets the warm-up)")
    ap.add_argument("--ttt", type=int, default=3, help="TTT steps, trained and scored")
    ap.add_argument("--eval-samples", type=int, default=64, help="held-out samples (the last N)")
    ap.add_argument("--bf16", action="store_true", help="autocast (fast only with avx512_bf16/AMX or a GPU)")
    ap.add_argument("--arm-features", nargs="*", default=[], metavar="ARM=DIR",
                    help="train ARM on DIR (the same samples stored otherwise, e.g. fp8); scored on --features")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="training config overrides for every arm (before the arm's own), e.g. head.draft_vocab_size=4096")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per training run")
    ap.add_argument("--parallel", type=int, default=1, help="training runs at once")
    ap.add_argument("--decode-questions", type=int, default=8, help="MT-bench questions each head decodes (0: none)")
    ap.add_argument("--decode-tokens", type=int, default=128, help="new tokens per decoded question")
    ap.add_argument("--reference", default="base", choices=list(ARMS),
                    help="the arm every other is compared with (added to --arms if missing)")
    ap.add_argument("--train-only", action="store_true",
                    help="train the listed arms and seeds only (no base added, no scoring): to split a grid over "
                         "cores or machines; a later run without it reuses the finished heads and scores them")
    a = ap.parse_args()
    if a.reference not in a.arms and not a.train_only:
        a.arms.insert(0, a.reference)
    steps, epochs = steps_for(a)
    runs = [(arm, seed) for seed in a.seeds for arm in a.arms]
    with ThreadPoolExecutor(a.parallel) as pool:  # a.threads each: small matmuls scale poorly past 1-2 cores
        heads = dict(zip(runs, pool.map(lambda r: train(*r, a, steps, epochs), runs)))
    if a.train_only:
        return
    scores = {}
    for (arm, seed), head in heads.items():
        cached = head.parent / "per_sample.json"
        if not cached.exists():
            write_json(cached, per_sample(head, a, arm))  # atomic: a killed scoring leaves no half file to reuse
        scores.setdefault(arm, {})[seed] = json.loads(cached.read_text())
    seen = {f"{arm}-s{seed}": training_record(head.parent) for (arm, seed), head in heads.items()}
    report = {"runs": seen, "minutes": a.minutes, "steps": steps, "epochs": epochs, "ttt": a.ttt, "seeds": a.seeds, "held_out": len(scores[a.reference][a.seeds[0]]),
              "reference": a.reference, "arms": compare(scores, a.reference)}
    if a.decode_questions:
        for arm, d in decode_all(heads, a).items():
            report["arms"][arm]["decode_tau"], report["arms"][arm]["decode_tau_per_seed"] = d["tau"], d["per_seed"]
        report["decode"] = {"questions": a.decode_questions, "new_tokens": a.decode_tokens, "chain_depth": a.ttt}
    write_json(Path(a.out) / "report.json", report, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
