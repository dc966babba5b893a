"""``eaglekit bench engine=vllm``: real `vllm serve` processes (vLLM's CPU backend) on the target's folder.

Configurations, each its own server, benched one after another (vLLM's CPU backend takes every core; two
servers side by side would share them), each prompt set ``repeats`` times:

- ``plain``: the target alone — the baseline and the reference every greedy output is compared with;
- one per head (``head=`` and ``heads=[...]``): the head exported as vLLM loads it (``--to vllm``; P-EAGLE
  ``--to speculators``), served with its kind's method (EAGLE-3 and P-EAGLE ``eagle3``, DFlash ``dflash``)
  and ``num_speculative_tokens`` = ``n_max`` (default 3) for a chain head, the trained block for a
  parallel one (P-EAGLE with ``parallel_drafting``).

Tokens/s is new tokens over the requests' wall time (the prefill included: vLLM reports no decode phase per
request), the median over repeats; acceptance comes from vLLM's own counters (``/metrics``: drafts, draft
tokens, accepted), as its acceptance length 1 + accepted / drafts. Beside it, eaglekit's τ for the same head
and the same number of speculative tokens: a chain head replayed on vLLM's own outputs (``replay``, like for
like), and every head through ``decode.generate`` on the same prompts (fp32 both sides: the same text).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from eaglekit.bench.llama_cpp import first_diff, head_drafts, replay
from eaglekit.bench.prompts import load_questions
from eaglekit.engines import vllm_cpu
from eaglekit.fileio import write_json

CHAIN = 3  # vLLM's num_speculative_tokens for a chain head unless n_max= says otherwise


def speculative_config(head, folder: Path, n_max: int) -> dict:
    """vLLM's --speculative-config for ``head`` exported into ``folder``: its kind's method always written
    out (P-EAGLE: "eagle3" + parallel_drafting; without a method an older vLLM takes a draft model)."""
    cls, cfg = type(head), head.config
    k = cls.tokens_per_draft(cfg) if cls.parallel else (n_max or CHAIN)
    return {"method": cls.vllm_method, "model": str(folder), "num_speculative_tokens": int(k),
            **(cls.vllm_options if cls.parallel else {})}


def export_for_vllm(head, out: Path, verifier: str | None = None) -> Path:
    """``verifier``: the target folder or id the speculators layout (P-EAGLE) names as its verifier."""
    from eaglekit.export import export_head

    if head.config.kind == "peagle":  # the vllm layout has no P-EAGLE fields
        return export_head(head, out, "speculators", overwrite=True, verifier=verifier)
    return export_head(head, out, "vllm", overwrite=True)


def run_engine_bench(cfg) -> dict:
    from eaglekit.export import load_head
    from eaglekit.target import load_target, resolve

    root = vllm_cpu.require()
    target = load_target(cfg.target)
    folder = resolve(cfg.target)[0]
    paths = [p for p in [cfg.head, *cfg.heads] if p]
    heads = {Path(p).parent.name if Path(p).name == "final" else Path(p).name: load_head(p, target) for p in paths}
    questions = load_questions(cfg.dataset, cfg.prompts, cfg.prompt_order)
    prompts = [target.chat_ids(text)[0].tolist() for _, text in questions]
    out = Path(cfg.out)
    confs, runs, starts, failed = {"plain": None}, {}, {}, {}
    for name, head in heads.items():
        if (why := getattr(type(head), "vllm_refusal", None)) is not None:  # a kind its CPU backend cannot run
            failed[name] = {"error": why}  # reported with its reason; no server started for it
            continue
        confs[name] = speculative_config(head, export_for_vllm(head, out / "heads" / name, str(folder)), cfg.n_max)
    for name, spec in confs.items():
        t0 = time.perf_counter()
        try:
            with vllm_cpu.Server(folder, speculative=spec, threads=cfg.threads or None, root=root) as s:
                starts[name] = time.perf_counter() - t0
                s.complete(prompts[0][:16], 4)  # warm-up
                runs[name] = [[s.complete(ids, cfg.max_new_tokens) for ids in prompts] for _ in range(cfg.repeats)]
        except vllm_cpu.VllmError as e:  # a kind this vLLM cannot serve is reported, the others still run
            if name == "plain":
                raise
            failed[name] = {"speculative_config": spec, "error": str(e)[-1500:]}
    report = summarise(runs)
    report["failed"] = failed
    for name, head in heads.items():
        if name in failed:
            continue
        report["results"][name]["speculative_config"] = confs[name]
        report["results"][name]["eaglekit"] = eaglekit_tau(target, head, prompts, runs[name][0],
                                                           confs[name]["num_speculative_tokens"])
    return {"config": asdict(cfg), "engine": f"vLLM CPU backend (vllm-cpu=={vllm_cpu.VERSION})",
            "target_dir": str(folder), "server_start_s": starts, "threads": cfg.threads or None,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **report}


def summarise(runs: dict) -> dict:
    def tps(rep):
        return sum(len(o.tokens) for o in rep) / sum(o.seconds for o in rep)

    refs = runs["plain"][0]
    plain = [tps(rep) for rep in runs["plain"]]
    results = {}
    for name, reps in runs.items():
        speeds = [tps(rep) for rep in reps]
        first = reps[0]
        drafts, drafted, accepted = (sum(getattr(o, k) for o in first) for k in ("drafts", "draft_tokens", "accepted"))
        diffs = [first_diff(o.tokens, r.tokens) for o, r in zip(first, refs)]
        results[name] = {
            "tokens_per_s": statistics.median(speeds), "repeats_tokens_per_s": speeds,
            "speedup_vs_plain": statistics.median(s / p for s, p in zip(speeds, plain)),
            "drafts": drafts, "draft_tokens": drafted, "accepted": accepted,
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance": accepted / drafted if drafted else None,
            "identical_to_plain": f"{sum(d is None for d in diffs)}/{len(refs)}", "first_differences": diffs,
            "tokens_per_prompt": [len(o.tokens) for o in first],
        }
    return {"results": results}


@torch.no_grad()
def eaglekit_tau(target, head, prompts, outs, k: int) -> dict:
    """eaglekit's τ for ``head`` at ``k`` speculative tokens, a chain as vLLM drafts it: a chain head's drafts
    replayed on vLLM's own outputs, and every head through decode.generate (its own fp32 text)."""
    from eaglekit import decode
    from eaglekit.decode.drafters import TreeSpec

    res = {}
    if not type(head).parallel:
        reps = [replay(ids + o.tokens, len(ids), *head_drafts(target, head, ids, o.tokens, k), n_max=k)
                for ids, o in zip(prompts, outs)]
        res["tau_replay_on_server_outputs"] = (sum(r["steps"] * r["tau"] for r in reps)
                                               / max(sum(r["steps"] for r in reps), 1))
    tree = TreeSpec(depth=k, top_k=1, total_tokens=k)  # vLLM drafts a chain of k, a parallel head's block too
    own = [decode.generate(target, head, torch.tensor([ids]), len(o.tokens), eos_token_id=False, tree=tree).stats
           for ids, o in zip(prompts, outs)]
    res["tau_decode_generate"] = (sum(sum(s.accept_lengths) for s in own)
                                  / max(sum(len(s.accept_lengths) for s in own), 1))
    return res


def table(report: dict) -> str:
    rows = ["| configuration | tok/s | speedup | acceptance length (vLLM) | eaglekit τ (replay / generate) | identical |",
            "|---|---|---|---|---|---|"]
    for name, r in report["results"].items():
        al = f"{r['acceptance_length']:.3f}" if r["acceptance_length"] else "—"
        e = r.get("eaglekit", {})
        ek = " / ".join(f"{e[k]:.3f}" if k in e else "—" for k in ("tau_replay_on_server_outputs", "tau_decode_generate"))
        rows.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup_vs_plain']:.2f}x | {al} | "
                    f"{ek if e else '—'} | {r['identical_to_plain']} |")
    for name, f in report.get("failed", {}).items():
        rows.append(f"| {name} | failed to serve: {f['error'].strip().splitlines()[-1][:120]} | | | | |")
    return "\n".join(rows)


def write(report: dict, out: str) -> Path:
    c = report["config"]
    name = f"vllm-{Path(c['target']).name}-{c['dataset']}-{time.strftime('%Y%m%d-%H%M%S')}"
    return write_json(Path(out) / f"{name}.json", report)
