"""``eaglekit bench``: τ, tokens/s and speedup vs plain decoding, measured side by side in one run.

Methods per prompt, interleaved so that machine drift hits all alike (their order balanced over the
prompts, ``methods.method_order``): ``plain`` (our loop, no
drafter: the baseline), ``ours`` (our loop with the head or draft model), with ``lookup_tokens=N`` (or
``2,5,10``) ``lookup`` and ``ours_lookup`` (our loop with a prompt-lookup branch, alone and grafted onto
ours), ``hf`` (transformers' ``generate``), ``hf_lookup`` (prompt lookup decoding) and, with a draft
model, ``hf_assisted`` (transformers' assisted generation, same pair): see ``methods``. Each (method, temperature) is repeated; the report
takes the median over repeats of the total tokens/s over the prompt set. Per prompt, ``plain`` and
``ours`` keep their tokens and seconds per repeat (and ``ours`` its acceptance per depth), from which
the report adds the speedup per prompt category and the acceptance per draft depth. For the methods of
our loop it sets the decode phase's measured speedup beside the one their acceptance and step costs
predict (``theory.expectations``), and the drafter's memory beside the target's (``theory.memory``).
Writes JSON and PNGs (``report``, ``plots``).

    eaglekit bench target=smollm2-135m-instruct head=runs/smollm2/final prompts=20
    eaglekit bench target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct dataset=humaneval

With ``batch_sizes=[1,2,4,8,16]`` it measures batched decoding instead: plain batched decoding vs
drafting per batch size, with the speedup expected from the measured acceptance (``bench.batch``).

With ``tp_size=N`` under ``torchrun --nproc_per_node N`` the target is split over the N processes, as for
``eaglekit generate``: every process runs the same bench (a fixed ``tree=``: ``tree=auto`` is refused, as
each process would time its own costs; the same prompts, orders and seeds), the first prints and writes.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import asdict, dataclass, field
from typing import Annotated, Literal

import torch
from pydantic import Field

from eaglekit.bench.batch import batch_table, run_batch_bench, write_batch
from eaglekit.bench.methods import methods, run_in_order
from eaglekit.bench.prompts import load_questions
from eaglekit.bench.report import rates, speedup_per_category, summarise, table, write
from eaglekit.bench.theory import memory
from eaglekit.config import Dtype, NonNegFloat, NonNegInt, PosInt, load_config
from eaglekit.decode import cost
from eaglekit.decode.cli import CPU_LINEAR, load_models, parse_tree, refuse_auto_tree_split
from eaglekit.decode.stats import DecodeStats
from eaglekit.target.tensor_parallel import launch_layout
from eaglekit.timing import load_average


@dataclass
class BenchConfig:
    target: str = "smollm2-135m-instruct"
    head: str | None = None
    draft: str | None = None
    dataset: Literal["mt-bench", "humaneval"] = "mt-bench"  # MT-bench first turns, or HumanEval
    prompts: PosInt = 10
    prompt_order: Literal["first", "spread"] = "first"  # the first n questions, or round-robin over categories
    max_new_tokens: PosInt = 128
    temperatures: Annotated[list[NonNegFloat], Field(min_length=1)] = field(default_factory=lambda: [0.0, 1.0])
    repeats: PosInt = 3
    tree: str = "auto"
    gamma: PosInt = 4
    draft_tree: str | None = None  # with draft=: "depth,top_k,total_tokens", our loop drafts a tree, not a chain
    hf_baselines: bool = True
    prompt_lookup_tokens: PosInt = 10
    lookup_tokens: int | list | str = 0  # > 0 (or "2,5,10", lengths per match as in generate's prompt_lookup):
    # add "lookup" (our loop, prompt lookup only) and, with a head or draft_tree, "ours_lookup" (drafter +
    # lookup). hf_lookup keeps transformers' own settings (prompt_lookup_tokens, n-gram 2)
    assistant_tokens: list[PosInt] = field(default_factory=lambda: [4, 8])  # best of these is reported
    dtype: Dtype = "float32"  # read by config.parse_dtype (through load_target)
    device: str = "cpu"
    seed: int = 0
    threads: NonNegInt = 0  # torch CPU threads (0 = torch's default)
    cpu_linear: CPU_LINEAR = "packed"  # "packed" (oneDNN pre-packed weights, every method alike) or "aten"
    compile: bool = False  # our loop's verify forward through torch.compile (static shapes; CUDA graphs on a GPU)
    out: str = "benchmarks/results/decode"
    batch_sizes: list[PosInt] = field(default_factory=list)  # e.g. [1,2,4,8,16]: the batch bench (bench.batch)
    tp_size: PosInt = 1  # > 1: the target split over tp_size processes (torchrun --nproc_per_node tp_size), each
    # running the same bench (fixed tree, same prompts and seeds); the first prints and writes the report
    # engine=llama.cpp: real llama-server processes on the target's GGUF (bench.llama_cpp); `threads` is theirs,
    # `draft` a draft model's GGUF (or embedded name), `gamma` its draft length
    # engine=vllm: real `vllm serve` processes (vLLM's CPU backend, bench.vllm) without and with each head of
    # `head` and `heads`; `n_max` a chain head's num_speculative_tokens (0 = 3)
    engine: Literal["eaglekit", "llama.cpp", "vllm"] = "eaglekit"
    heads: list[str] = field(default_factory=list)
    target_gguf: str | None = None  # default: the embedded target's own GGUF file
    head_gguf: str | None = None  # default: `head` exported with export --to llama.cpp (gguf_type)
    gguf_type: Literal["f32", "f16", "bf16", "q8_0"] = "f16"
    n_max: NonNegInt = 0  # --spec-draft-n-max of the head; 0 = the planner's choice
    p_min: float = -1.0  # --spec-draft-p-min of the head; < 0 = the planner's choice
    plan_p_min: list[NonNegFloat] = field(default_factory=lambda: [0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    sweep_n_max: list[PosInt] = field(default_factory=lambda: [1, 2, 3, 4, 6])  # measured beside the choice
    sweep_p_min: list[NonNegFloat] = field(default_factory=lambda: [0.0, 0.5, 0.8])
    ngram_types: list[str] = field(default_factory=lambda: ["ngram-mod"])  # llama.cpp's n-gram modes to bench
    combine_ngram: list[str] = field(default_factory=lambda: ["ngram-mod"])  # head + this type (one server)
    calibration_prompts: NonNegInt = 4  # the planner's prompts: the next questions after the benched ones


def run_bench(cfg: BenchConfig) -> dict:
    target, drafter, packed = load_models(cfg)  # HF baselines run the same (packed) modules
    tree, plan = parse_tree(cfg.tree), None
    if tree == "auto" and cfg.head:
        plan = cost.auto_plan(target, drafter)
    questions = load_questions(cfg.dataset, cfg.prompts, cfg.prompt_order)
    prompts = [target.chat_ids(text) for _, text in questions]
    fns = methods(cfg, target, drafter, plan or tree)
    for fn in fns.values():  # warm-up (allocations, auto-tree cache, kernels)
        fn(prompts[0][:, :16], 0.0, 0)
    results, per_prompt, per_category, acceptance = {}, {}, {}, {}
    for temp in cfg.temperatures:
        runs, records, pooled = bench_temperature(cfg, fns, prompts, [c for c, _ in questions], temp)
        results[str(temp)] = summarise(runs, pooled, cfg.gamma if cfg.draft and not cfg.draft_tree else None)
        per_prompt[str(temp)] = records
        if "ours" in fns:
            per_category[str(temp)] = speedup_per_category(records)
            acceptance[str(temp)] = rates(pooled["ours"])
    extra = {"speedup_per_category": per_category, "acceptance_per_depth": acceptance} if "ours" in fns else {}
    return dict(config=asdict(cfg), tree=str(plan.spec if plan else tree),
                nodes_with_lookup=plan.nodes_with_lookup if plan else None,
                memory=memory(drafter, target, max(p.shape[1] for p in prompts) + cfg.max_new_tokens),
                device=str(target.device), threads=torch.get_num_threads(), packed_linears=packed,
                torch=torch.__version__, load_average=load_average(),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), results=results,
                per_prompt=per_prompt, **extra)


class _Totals:
    """One method's sums over a repeat's prompts: tokens and seconds (end to end), accepted lengths, outputs
    equal to plain's, and from its DecodeStats (our loop only) the seconds drafting and verifying, the verify
    forwards and the decode phase (after the prefill, which emits the first token)."""

    def __init__(self):
        self.tokens, self.seconds, self.lengths, self.same = 0, 0.0, [], 0
        self.draft_s = self.verify_s = self.decode_s = 0.0
        self.forwards = self.decode_tokens = 0

    def add(self, n: int, seconds: float, stats, same: bool) -> None:
        self.tokens, self.seconds, self.same = self.tokens + n, self.seconds + seconds, self.same + same
        if stats is not None:
            self.lengths += stats.accept_lengths
            self.draft_s += stats.draft_s
            self.verify_s += stats.verify_s
            self.forwards += len(stats.accept_lengths)
            self.decode_tokens += max(stats.new_tokens - 1, 0)
            self.decode_s += stats.total_s - stats.prefill_s

    def run(self, prompts: int, temp: float) -> dict:
        timed_steps = self.forwards and self.decode_s > 0
        return {"tokens": self.tokens, "seconds": self.seconds, "tokens_per_s": self.tokens / self.seconds,
                "tau": sum(self.lengths) / len(self.lengths) if self.lengths else None,
                # greedy: lossless methods give plain's tokens (bf16 ties may differ)
                "identical_to_plain": f"{self.same}/{prompts}" if temp == 0 else None,
                "decode_tokens_per_s": self.decode_tokens / self.decode_s if timed_steps else None,
                "draft_s_per_forward": self.draft_s / self.forwards if timed_steps else None,
                "verify_s_per_forward": self.verify_s / self.forwards if timed_steps else None}


def bench_temperature(cfg: BenchConfig, fns: dict, prompts: list, categories: list[str], temp: float):
    """Every method on every prompt, ``cfg.repeats`` times. Returns (per-method totals per repeat,
    per-prompt records of plain and ours, each method's DecodeStats pooled over all prompts and repeats,
    for the methods of our loop)."""
    runs = {name: [] for name in fns}
    records = [dict(category=c, **{m: {"tokens": [], "seconds": []} for m in ("plain", "ours") if m in fns})
               for c in categories]
    ours_stats = [DecodeStats() for _ in prompts]  # per prompt, pooled over repeats
    pooled = {}
    for rep in range(cfg.repeats):
        totals = {name: _Totals() for name in fns}
        for i, ids in enumerate(prompts):
            done = run_in_order(fns, rep * len(prompts) + i, ids, temp, cfg.seed + 1000 * rep + i)
            plain = done["plain"][0][2].cpu()
            for name, ((n, stats, seq), dt) in done.items():
                totals[name].add(n, dt, stats, torch.equal(seq.cpu(), plain))
                if stats is not None:
                    pooled.setdefault(name, DecodeStats()).pool(stats)
                if name in records[i]:
                    records[i][name]["tokens"].append(n)
                    records[i][name]["seconds"].append(dt)
                if name == "ours":
                    ours_stats[i].pool(stats)
        for name, total in totals.items():
            runs[name].append(total.run(len(prompts), temp))
    for rec, stats in zip(records, ours_stats):
        if "ours" in rec:
            rec["ours"]["tau"] = stats.tau
            rec["ours"]["acceptance_per_depth"] = rates(stats)
    return runs, records, pooled


def add_arguments(p):
    p.epilog = "keys: " + ", ".join(BenchConfig.__dataclass_fields__)


def run(args) -> int:
    cfg = load_config(BenchConfig, args.config, args.overrides)
    refuse_auto_tree_split(cfg.tp_size, cfg.tree)  # before any model loads
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.engine != "eaglekit":  # real servers: bench.llama_cpp (JSON + PNG) or bench.vllm (JSON)
        engine = importlib.import_module(f"eaglekit.bench.{cfg.engine.replace('.', '_')}")
        report = engine.run_engine_bench(cfg)
        path = engine.write(report, cfg.out)
        print(engine.table(report))
        print(f"wrote {path}")
        return 0
    report = run_batch_bench(cfg) if cfg.batch_sizes else run_bench(cfg)
    if launch_layout(cfg.tp_size).rank:  # a split target: the first process writes the report
        return 0
    path = (write_batch if cfg.batch_sizes else write)(report, cfg.out)
    print((batch_table if cfg.batch_sizes else table)(report))
    print(f"wrote {path} (and PNGs beside it)")
    return 0
