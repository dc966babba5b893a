"""``eaglekit bench``: τ, tokens/s and speedup vs plain decoding, measured side by side in one run.

Methods per prompt, interleaved so that machine drift hits all alike: ``plain`` (our loop, no
drafter: the baseline), ``ours`` (our loop with the head or draft model), with ``lookup_tokens=N`` (or
``2,5,10``) ``lookup`` and ``ours_lookup`` (our loop with a prompt-lookup branch, alone and grafted onto
ours), ``hf`` (transformers' ``generate``), ``hf_lookup`` (prompt lookup decoding) and, with a draft model, ``hf_assisted``
(transformers' assisted generation, same pair). Each (method, temperature) is repeated; the report
takes the median over repeats of the total tokens/s over the prompt set. Per prompt, ``plain`` and
``ours`` keep their tokens and seconds per repeat (and ``ours`` its acceptance per depth), from which
the report adds the speedup per prompt category and the acceptance per draft depth. Writes JSON and
PNGs (``bench_plots``).

    eaglekit bench target=smollm2-135m-instruct head=runs/smollm2/final prompts=20
    eaglekit bench target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct dataset=humaneval
"""
from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eaglekit.config import load_config
from eaglekit.decode.bench_plots import plot, plot_acceptance, plot_categories


@dataclass
class BenchConfig:
    target: str = "smollm2-135m-instruct"
    head: str | None = None
    draft: str | None = None
    dataset: str = "mt-bench"  # "mt-bench" (first turns) or "humaneval"
    prompts: int = 10
    prompt_order: str = "first"  # "first": the first n questions; "spread": round-robin over categories
    max_new_tokens: int = 128
    temperatures: list = field(default_factory=lambda: [0.0, 1.0])
    repeats: int = 3
    tree: str = "auto"
    gamma: int = 4
    draft_tree: str | None = None  # with draft=: "depth,top_k,total_tokens", our loop drafts a tree, not a chain
    hf_baselines: bool = True
    prompt_lookup_tokens: int = 10
    lookup_tokens: int | list | str = 0  # > 0 (or "2,5,10", lengths per match as in generate's prompt_lookup):
    # add "lookup" (our loop, prompt lookup only) and, with a head or draft_tree, "ours_lookup" (drafter +
    # lookup). hf_lookup keeps transformers' own settings (prompt_lookup_tokens, n-gram 2)
    assistant_tokens: list = field(default_factory=lambda: [4, 8])  # best of these is reported
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    threads: int = 0  # torch CPU threads (0 = torch's default)
    cpu_linear: str = "packed"  # "packed" (oneDNN pre-packed weights, every method alike) or "aten"
    out: str = "benchmarks/results/decode"


def load_questions(dataset: str, n: int, order: str = "first") -> list[tuple[str, str]]:
    """``[(category, text)]``: MT-bench first turns with their category, or HumanEval ("humaneval")."""
    from eaglekit import assets

    if order not in ("first", "spread"):
        raise ValueError(f"prompt_order={order!r}: expected 'first' or 'spread'")
    if dataset == "mt-bench":
        items = [(q["category"], q["turns"][0]) for q in assets.load_mt_bench()]
    elif dataset == "humaneval":
        items = [("humaneval", "Complete this Python function:\n```python\n" + p["prompt"] + "```")
                 for p in assets.load_humaneval()]
    else:
        raise ValueError(f"dataset={dataset!r}: expected 'mt-bench' or 'humaneval'")
    if order == "spread":  # MT-bench lists 10 questions per category in a row: take one of each in turn
        groups = {}
        for item in items:
            groups.setdefault(item[0], []).append(item)
        items = [it for row in itertools.zip_longest(*groups.values()) for it in row if it is not None]
    return items[:n]


def load_prompts(target, dataset: str, n: int, order: str = "first") -> list[torch.Tensor]:
    return [target.chat_ids(text) for _, text in load_questions(dataset, n, order)]


def _timed(fn):
    if torch.cuda.is_available():  # start from an idle device: earlier queued kernels are not this call's
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return res, time.perf_counter() - t0


def methods(cfg: BenchConfig, target, drafter, tree):
    """name -> fn(ids, temperature, seed) -> (new tokens, DecodeStats or None, sequences).
    ``tree``: a TreeSpec, or the head's auto ``Plan`` resolved once (drafted with as generate's
    ``tree="auto"`` does, but always: no fallback to plain decoding)."""
    from eaglekit.decode.generate import generate

    def ours(dr, lookup=0):
        def fn(ids, temp, seed):
            out = generate(target, dr, ids, cfg.max_new_tokens, temperature=temp, seed=seed, tree=tree,
                           gamma=cfg.gamma, prompt_lookup=lookup)
            return out.stats.new_tokens, out.stats, out.sequences
        return fn

    def hf(**kw):
        def fn(ids, temp, seed):
            torch.manual_seed(seed)
            sample = dict(do_sample=True, temperature=temp, top_p=1.0, top_k=0) if temp > 0 else \
                dict(do_sample=False, temperature=None, top_p=None, top_k=None)
            seq = target.model.generate(ids.to(target.device), max_new_tokens=cfg.max_new_tokens, **sample,
                                        **kw)
            return seq.shape[1] - ids.shape[1], None, seq
        return fn

    from eaglekit.decode.cli import with_draft_tree

    out = {"plain": ours(None)}
    dr = None if drafter is None else with_draft_tree(cfg, target, drafter)
    if dr is not None:
        out["ours"] = ours(dr)
    if cfg.lookup_tokens:
        out["lookup"] = ours(None, cfg.lookup_tokens)
        if cfg.head or cfg.draft_tree:  # a tree of chosen tokens (a draft-model chain is sampled)
            out["ours_lookup"] = ours(dr, cfg.lookup_tokens)
    if cfg.hf_baselines:
        out["hf"] = hf()
        out["hf_lookup"] = hf(prompt_lookup_num_tokens=cfg.prompt_lookup_tokens)
        if cfg.draft:  # fixed-length drafts, as our loop does (no dynamic schedule or early stop)
            gc = drafter.model.generation_config
            gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = "constant", 0.0
            for k in cfg.assistant_tokens:
                out[f"hf_assisted_{k}"] = _assisted(hf, drafter, k)
    return out


def _assisted(hf, drafter, k):
    inner = hf(assistant_model=drafter.model)

    def fn(ids, temp, seed):
        drafter.model.generation_config.num_assistant_tokens = k
        return inner(ids, temp, seed)
    return fn


def run_bench(cfg: BenchConfig) -> dict:
    from eaglekit.decode.cli import load_drafter, parse_tree, use_cpu_linear
    from eaglekit.target import load_target

    target = load_target(cfg.target, dtype=getattr(torch, cfg.dtype), device=cfg.device)
    drafter = load_drafter(cfg, target)
    packed = use_cpu_linear(cfg.cpu_linear, target, drafter)  # HF baselines run the same packed modules
    tree, plan = parse_tree(cfg.tree), None
    if tree == "auto" and cfg.head:
        from eaglekit.decode import plan as planner

        plan = planner.auto_plan(target, drafter)
    questions = load_questions(cfg.dataset, cfg.prompts, cfg.prompt_order)
    prompts = [target.chat_ids(text) for _, text in questions]
    fns = methods(cfg, target, drafter, plan or tree)
    for fn in fns.values():  # warm-up (allocations, auto-tree cache, kernels)
        fn(prompts[0][:, :16], 0.0, 0)
    results, per_prompt, per_category, acceptance = {}, {}, {}, {}
    for temp in cfg.temperatures:
        runs, records, pooled = bench_temperature(cfg, fns, prompts, [c for c, _ in questions], temp)
        results[str(temp)] = summarise(runs)
        per_prompt[str(temp)] = records
        if "ours" in fns:
            per_category[str(temp)] = speedup_per_category(records)
            acceptance[str(temp)] = _rates(pooled)
    extra = dict(speedup_per_category=per_category, acceptance_per_depth=acceptance) if "ours" in fns else {}
    return dict(config=asdict(cfg), tree=str(plan.spec if plan else tree),
                nodes_with_lookup=plan.nodes_with_lookup if plan else None,
                device=str(target.device), threads=torch.get_num_threads(), packed_linears=packed,
                torch=torch.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), results=results,
                per_prompt=per_prompt, **extra)


def bench_temperature(cfg: BenchConfig, fns: dict, prompts: list, categories: list[str], temp: float):
    """Every method on every prompt, ``cfg.repeats`` times. Returns (per-method totals per repeat,
    per-prompt records of plain and ours, ours' DecodeStats pooled over all prompts and repeats)."""
    from eaglekit.decode.stats import DecodeStats

    runs = {name: [] for name in fns}
    records = [dict(category=c, **{m: dict(tokens=[], seconds=[]) for m in ("plain", "ours") if m in fns})
               for c in categories]
    ours_stats = [DecodeStats() for _ in prompts]  # per prompt, pooled over repeats
    for rep in range(cfg.repeats):
        totals = {name: [0, 0.0, [], 0] for name in fns}
        for i, ids in enumerate(prompts):
            plain_seq = None
            for name, fn in fns.items():
                seed = cfg.seed + 1000 * rep + i
                (n, stats, seq), dt = _timed(lambda fn=fn, ids=ids, seed=seed: fn(ids, temp, seed))
                plain_seq = seq if name == "plain" else plain_seq
                totals[name][0] += n
                totals[name][1] += dt
                totals[name][2] += stats.accept_lengths if stats else []
                totals[name][3] += int(torch.equal(seq.cpu(), plain_seq.cpu()))
                if name in records[i]:
                    records[i][name]["tokens"].append(n)
                    records[i][name]["seconds"].append(dt)
                if name == "ours":
                    ours_stats[i].pool(stats)
        for name, (n, dt, lengths, same) in totals.items():
            runs[name].append(dict(tokens=n, seconds=dt, tokens_per_s=n / dt,
                                   tau=sum(lengths) / len(lengths) if lengths else None,
                                   # greedy: lossless methods give plain's tokens (bf16 ties may differ)
                                   identical_to_plain=f"{same}/{len(prompts)}" if temp == 0 else None))
    pooled = DecodeStats()
    for rec, stats in zip(records, ours_stats):
        if "ours" in rec:
            rec["ours"]["tau"] = stats.tau
            rec["ours"]["acceptance_per_depth"] = _rates(stats)
            pooled.pool(stats)
    return runs, records, pooled


def _rates(stats) -> list[float | None]:
    """DecodeStats.acceptance_per_depth, the one definition: the rate at depth d is
    P(the depth-d draft token is accepted | depths 1..d-1 were accepted and the tree reached depth d),
    i.e. #steps accepting >= d drafted tokens / #steps accepting >= d-1 whose tree reached depth d.
    A conditional rate, so not monotone in d. None where no step qualified (NaN is not JSON)."""
    return [None if math.isnan(r) else r for r in stats.acceptance_per_depth]


def speedup_per_category(records: list[dict]) -> dict[str, float]:
    """category -> median over repeats of ours' tokens/s over plain's, totals over the category's
    prompts (= plain seconds / ours seconds when both emit the same tokens, as greedy decoding does)."""
    out = {}
    for cat in dict.fromkeys(r["category"] for r in records):
        rs = [r for r in records if r["category"] == cat]
        repeats = range(len(rs[0]["plain"]["seconds"]))
        out[cat] = statistics.median(_tokens_per_s(rs, "ours", k) / _tokens_per_s(rs, "plain", k)
                                     for k in repeats)
    return out


def _tokens_per_s(records: list[dict], method: str, rep: int) -> float:
    return sum(r[method]["tokens"][rep] for r in records) / sum(r[method]["seconds"][rep] for r in records)


def summarise(runs: dict) -> dict:
    plain = statistics.median(r["tokens_per_s"] for r in runs["plain"])
    out = {}
    for name, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        taus = [r["tau"] for r in rs if r["tau"] is not None]
        same = [r["identical_to_plain"] for r in rs if r.get("identical_to_plain")]
        out[name] = dict(tokens_per_s=tps, speedup_vs_plain=tps / plain,
                         tau=statistics.median(taus) if taus else None,
                         identical_to_plain=", ".join(same) if same else None, repeats=rs)
    assisted = [n for n in out if n.startswith("hf_assisted_")]
    if assisted:
        best = max(assisted, key=lambda n: out[n]["tokens_per_s"])
        out[best]["best_of_assisted"] = True
    return out


def write(report: dict, out_dir: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = report["config"]
    parts = (c["target"], c["head"] or c["draft"] or "plain", c["dataset"])
    stem = "-".join(Path(str(x)).name for x in parts)
    path = out / f"{stem}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)
    plot(report, path.with_suffix(".png"))
    if "acceptance_per_depth" in report:  # a drafter was given
        plot_acceptance(report, path.with_name(f"{path.stem}-acceptance.png"))
        plot_categories(report, path.with_name(f"{path.stem}-categories.png"))
    return path


def table(report: dict) -> str:
    lines = ["| T | method | tokens/s | speedup vs plain | τ | same tokens as plain |", "|---|---|---|---|---|---|"]
    for temp, res in report["results"].items():
        for name, r in res.items():
            tau = f"{r['tau']:.2f}" if r["tau"] else ""
            tps, speedup = r["tokens_per_s"], r["speedup_vs_plain"]
            lines.append(f"| {temp} | {name} | {tps:.1f} | {speedup:.2f}x | {tau} | {r.get('identical_to_plain') or ''} |")
    return "\n".join(lines)


def add_arguments(p):
    p.epilog = "keys: " + ", ".join(BenchConfig.__dataclass_fields__)


def run(args) -> int:
    cfg = load_config(BenchConfig, args.config, args.overrides)
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    report = run_bench(cfg)
    path = write(report, cfg.out)
    print(table(report))
    print(f"wrote {path} (and PNGs beside it)")
    return 0
