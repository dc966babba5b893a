"""``eaglekit demo``: the main job, end to end, on the embedded default target (SmolLM2-135M-Instruct).

1. prepare: the target regenerates the first turn of a ShareGPT subset (self-distillation) and the
   draft vocabulary is built from its answers          (``eaglekit prepare``)
2. train:   an EAGLE-3 head on those conversations, online features     (``accelerate launch train_head.py``)
3. decode:  one MT-bench question per category, plain greedy decoding, EAGLE decoding and EAGLE + prompt
   lookup side by side in this run, timed as ``eaglekit bench`` times them (each question's methods
   ``--repeats`` times in a balanced order, speedups the median of paired ratios); prints a table (τ,
   speedup, identical) and one answer, and checks that every output is token-identical to plain
   decoding (lossless). Where other work keeps the CPUs busy it says so: such timings mean little.

Threads: every step uses one torch thread per CPU left free by other work at the start, waiting
passively at OpenMP barriers (``eaglekit.timing``): spinning threads beside another process made
training ~10x slower, not in proportion to the CPU taken.

Every step is the same command a user would type (printed before it runs) and resumes: a second run
reuses the regenerated data and the trained head (training is skipped once ``metrics.json`` and
``final/`` exist) and only decodes again. The head is left in
``<run_dir>/head/final``, ready for ``eaglekit export`` / ``eaglekit push``.
"""
from __future__ import annotations

import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from eaglekit import assets, decode
from eaglekit.bench.methods import run_in_order
from eaglekit.bench.prompts import load_questions
from eaglekit.decode.cli import parse_tree, use_cpu_linear
from eaglekit.decode.cost import Plan, auto_plan
from eaglekit.decode.lookup import branch_lengths
from eaglekit.export import load_head
from eaglekit.fileio import write_json
from eaglekit.target import load_target
from eaglekit.timing import busy_cpus, load_average, thread_env, threads_for
from eaglekit.train.config import load_train_config

ROOT = Path(__file__).resolve().parent.parent


def add_arguments(p):
    p.add_argument("--run-dir", default="runs/demo", help="where data, head and results go")
    p.add_argument("--conversations", type=int, default=128, help="ShareGPT conversations to regenerate")
    p.add_argument("--regen-tokens", type=int, default=192, help="max new tokens per regenerated answer")
    p.add_argument("--train-config", default=str(ROOT / "configs" / "smollm2-135m-eagle3.yaml"))
    p.add_argument("--epochs", type=int, default=6, help="training epochs over the regenerated data")
    p.add_argument("--questions", type=int, default=8,
                   help="MT-bench first turns to decode, one per category in turn (8 categories)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="new tokens per question and method (64 keeps a fresh clone's run, setup included, within "
                        "15 minutes on a 2-core AVX2-only CPU)")
    p.add_argument("--repeats", type=int, default=2,
                   help="decode each question's methods this many times (balanced order; medians of paired "
                        "ratios; every repeat's output is checked against plain)")
    p.add_argument("--tree", default="auto", help="'auto' or depth,top_k,total_tokens")
    p.add_argument("--prompt-lookup", default="2,5,10",
                   help="also decode with a prompt-lookup branch on the head's tree: N tokens, or one length per "
                        "match of 1, 2, 3 tokens (default 2,5,10, the measured best; 0: off)")


class StepFailed(RuntimeError):
    """A step's command failed; its own error is printed above it."""


def _run(cmd: list[str], threads: int | None = None) -> None:
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    # one progress bar per phase: ours, not transformers' per model load (HF_HUB_DISABLE_PROGRESS_BARS);
    # the training step runs on the CPU (accelerate launch --cpu): DeepSpeed need not guess, nor say so
    env = {"DS_ACCELERATOR": "cpu", **os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", **(thread_env(threads) if threads else {})}
    code = subprocess.run(cmd, check=False, env=env, cwd=ROOT).returncode  # a failure: StepFailed below
    if code:
        how = f"exit status {code}" if code > 0 else f"signal {-code}"
        raise StepFailed(f"the command above failed ({how}); running the demo again resumes where it stopped")


def prepare(run_dir: Path, n: int, regen_tokens: int, draft_vocab: int, threads: int | None = None) -> Path:
    data = run_dir / "data"
    _run([sys.executable, "-m", "eaglekit.cli", "prepare", "--config", str(ROOT / "configs/prepare-smollm2.yaml"),
          f"output_dir={data}", f"num_conversations={n}", "max_turns=1", "capture=false",
          f"draft_vocab_size={draft_vocab}", "regenerate.enabled=true", f"regenerate.max_new_tokens={regen_tokens}",
          "regenerate.max_prompt_tokens=384", "regenerate.batch_size=32", "regenerate.sort_window=4"], threads)
    return data


def train(run_dir: Path, data: Path, config: str, epochs: int, threads: int | None = None) -> Path:
    """Train the head (``accelerate launch train_head.py``) unless an earlier run finished it: a rerun of
    the trainer would continue from its last checkpoint and train the last steps again."""
    head = run_dir / "head"
    if (head / "metrics.json").is_file() and (head / "final" / "model.safetensors").is_file():  # written last
        print(f"\nthe head in {head / 'final'} is trained (delete {head} to train it again)", flush=True)
        return head / "final"
    accelerate = Path(sys.executable).with_name("accelerate")
    threads = threads or torch.get_num_threads()
    _run([str(accelerate), "launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
          "--num_cpu_threads_per_process", str(threads), "--mixed_precision", "no",
          "--dynamo_backend", "no", str(ROOT / "train_head.py"), "--config", config,
          f"data.conversations={data / 'regenerated.jsonl'}", f"data.draft_vocab={data / 'draft_vocab.safetensors'}",
          "data.num_conversations=0", f"optim.epochs={epochs}", f"output_dir={head}"], threads)
    return head / "final"


def demo_questions(n: int) -> list[tuple[str, str]]:
    """``[(category, text)]``: MT-bench first turns, one per category in turn (the bench's
    ``prompt_order=spread``)."""
    return load_questions("mt-bench", n, order="spread")


def decode_methods(target, head, max_new_tokens: int, tree, lookup=0) -> dict:
    """name -> fn(ids) -> (new tokens, DecodeStats, sequences), as ``eaglekit bench``'s methods: ``plain``,
    ``eagle`` (the head's tree) and, with ``lookup``, ``lookup`` (a prompt-lookup branch on that tree)."""
    def method(drafter, **kw):
        def fn(ids):
            out = decode.generate(target, drafter, ids, max_new_tokens=max_new_tokens, **kw)
            return out.stats.new_tokens, out.stats, out.sequences
        return fn

    fns = {"plain": method(None), "eagle": method(head, tree=tree)}
    if lookup:
        fns["lookup"] = method(head, tree=tree, prompt_lookup=lookup)
    return fns


def _paired(seconds: dict, name: str) -> float:
    """Median over repeats of plain's seconds over ``name``'s in the same repeat (both emit the same tokens)."""
    return statistics.median(p / m for p, m in zip(seconds["plain"], seconds[name]))


def decode_question(target, fns: dict, text: str, index: int, questions: int, repeats: int) -> dict:
    """One question decoded by every method ``repeats`` times, in ``run_in_order``'s balanced order (the k-th
    run of the bench's numbering: repeat r of question i is run r * questions + i); each output compared
    token for token with plain greedy decoding of the same repeat."""
    ids = target.chat_ids(text)
    runs = [run_in_order(fns, rep * questions + index, ids) for rep in range(repeats)]
    seconds = {name: [run[name][1] for run in runs] for name in fns}
    same = {name: all(torch.equal(run[name][0][2], run["plain"][0][2]) for run in runs) for name in fns}
    (_, fast, seq), _ = runs[0]["eagle"]
    answer = target.tokenizer.decode(seq[0, ids.shape[1]:], skip_special_tokens=True).strip()
    row = {"question": text, "tau": fast.tau, "new_tokens": fast.new_tokens, "seconds": seconds,
           "speedup": _paired(seconds, "eagle"), "identical": same["eagle"],
           "acceptance_per_depth": fast.acceptance_per_depth, "answer": answer}
    if "lookup" in fns:
        row.update(tau_lookup=runs[0]["lookup"][0][1].tau, speedup_lookup=_paired(seconds, "lookup"),
                   identical_lookup=same["lookup"])
    return row


def decode_side_by_side(target, head, questions: list[tuple[str, str]], max_new_tokens: int, tree,
                        lookup=0, repeats: int = 1) -> dict:
    """Plain vs EAGLE (vs EAGLE + a prompt-lookup branch, ``lookup`` as generate's ``prompt_lookup``) greedy
    decoding of ``questions`` (``[(category, text)]``): per-question rows and the totals (speedup: the median
    over repeats of each repeat's total plain seconds over the method's)."""
    fns = decode_methods(target, head, max_new_tokens, tree, lookup)
    rows = [{"category": category, **decode_question(target, fns, text, i, len(questions), repeats)}
            for i, (category, text) in enumerate(tqdm(questions, desc="decode", unit="question"))]
    totals = {name: [sum(r["seconds"][name][k] for r in rows) for k in range(repeats)] for name in fns}
    out = {"questions": len(rows), "repeats": repeats, "tau_mean": sum(r["tau"] for r in rows) / len(rows),
           "speedup": _paired(totals, "eagle"), "tree": str(tree), "rows": rows,
           "all_identical": all(r["identical"] and r.get("identical_lookup", True) for r in rows)}
    if lookup:
        out.update(prompt_lookup=lookup, tau_mean_lookup=sum(r["tau_lookup"] for r in rows) / len(rows),
                   speedup_lookup=_paired(totals, "lookup"))
    return out


def busy_note(busy: float | None, cpus: int, load: list[float] | None, threads: int) -> str | None:
    """One line saying the machine was too busy for the timings to mean much, or None: when other work kept
    more than half a CPU busy before decoding (``busy``, of ``cpus``), or the load average after it, less
    the demo's own ``threads``, says so."""
    others = max(busy or 0.0, (load[0] - threads) if load else 0.0)
    if others <= 0.5:
        return None
    return (f"machine too busy for timings (load {others:.1f} on {cpus} CPUs from other work; load average "
            f"{load[0] if load else float('nan'):.2f}): these speedups are not meaningful, rerun on a quiet "
            "machine (the outputs' exactness holds regardless)")


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def _line(width: int, question: str, category: str, *cells: str) -> str:
    return f"{_clip(question, width):<{width}}  {category:<10}" + "".join(f"  {c:>9}" for c in cells)


def results_table(result: dict, width: int = 36) -> str:
    """One line per question: the question (clipped to ``width``), its category, τ and speedup over plain
    (and with the lookup branch), whether every output was token-identical to plain; then the totals (and
    the busy-machine line, if any)."""
    lookup = "tau_lookup" in result["rows"][0]
    lines = [_line(width, "question", "category", "τ", "speedup", *(("τ +lookup", "speedup") if lookup else ()),
                   "identical")]
    for r in result["rows"]:
        cells = [f"{r['tau']:.2f}", f"{r['speedup']:.2f}x"]
        if lookup:
            cells += [f"{r['tau_lookup']:.2f}", f"{r['speedup_lookup']:.2f}x"]
        same = r["identical"] and r.get("identical_lookup", True)
        lines.append(_line(width, r["question"], r["category"], *cells, "yes" if same else "NO"))
    n = result["questions"]
    same = sum(r["identical"] and r.get("identical_lookup", True) for r in result["rows"])
    cells = [f"{result['tau_mean']:.2f}", f"{result['speedup']:.2f}x"]
    if lookup:
        cells += [f"{result['tau_mean_lookup']:.2f}", f"{result['speedup_lookup']:.2f}x"]
    lines.append(_line(width, f"all {n} (mean τ, total time)", "", *cells, f"{same}/{n}"))
    if result.get("machine_note"):
        lines.append(result["machine_note"])
    return "\n".join(lines)


def planner_line(plan: Plan) -> str:
    """The planner's choice for the demo and why, in one sentence: the tree it drafts with, and the tokens
    per second expected with it and with plain decoding, from the costs measured on this device."""
    spec = plan.spec
    tree = f"a tree of up to {spec.total_tokens} tokens, {spec.depth} deep, the top {spec.top_k} at each level"
    rates = (f"{plan.expected_tokens_per_s:.1f} tokens/s expected with {'it' if plan.drafting_pays else 'the best tree'} "
             f"against {plan.plain_tokens_per_s:.1f} with plain decoding, from the costs measured on this device")
    if plan.drafting_pays:
        return f"planner: drafting with {tree} ({rates})."
    return (f"planner: drafting would not pay here ({rates}): `eaglekit generate tree=auto` would not draft, "
            f"but the demo drafts anyway, with {tree}, to measure the head.")


def decode_phase(head_dir: Path, questions: int, max_new_tokens: int, tree, lookup=0, repeats: int = 1) -> dict:
    """Load the target and the trained head, pick the tree, decode, print the table and one answer."""
    hf_logging.disable_progress_bar()  # no weight-loading bar: the decode phase has its own
    measured = busy_cpus()
    busy, cpus = measured if measured else (None, os.cpu_count() or 1)
    torch.set_num_threads(threads_for(cpus, busy or 0.0))
    target = load_target(assets.DEFAULT_TARGET)
    head = load_head(head_dir, target)
    use_cpu_linear("packed", target, head)  # decoding only: oneDNN pre-packed weights, plain and EAGLE alike
    tree = parse_tree(tree)
    if tree == "auto":  # draft with the best measured tree even where plain would win, to show the head's τ
        plan = auto_plan(target, head)
        tree = plan.spec
        print(planner_line(plan), flush=True)
    result = decode_side_by_side(target, head, demo_questions(questions), max_new_tokens, tree, lookup, repeats)
    result.update(threads=torch.get_num_threads(), busy_cpus_before=busy, load_average_after=load_average())
    result["machine_note"] = busy_note(busy, cpus, result["load_average_after"], result["threads"])
    first = result["rows"][0]
    print(f"\n{results_table(result)}\n\nOne answer ({first['category']}; identical to plain decoding: "
          f"{'yes' if first['identical'] else 'NO'}):\n  Q: {_clip(first['question'], 300)}\n"
          "  A: " + first["answer"].replace("\n", "\n     "))
    return result


def run(args) -> int:
    torch.manual_seed(0)
    if str(args.prompt_lookup).strip() == "0":
        args.prompt_lookup = 0
    else:  # a bad value fails now, not after 20 minutes of preparing and training
        branch_lengths(args.prompt_lookup)
    t0 = time.perf_counter()
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    vocab = load_train_config(args.train_config).head.draft_vocab_size
    measured = busy_cpus()
    threads = threads_for(measured[1], measured[0]) if measured else torch.get_num_threads()
    if measured:
        print(f"{measured[1]} CPUs, {measured[0]:.1f} kept busy by other work: {threads} torch thread(s), "
              "waiting passively", flush=True)
    print(f"== 1/3 prepare: regenerate {args.conversations} ShareGPT first turns with the target")
    data = prepare(run_dir, args.conversations, args.regen_tokens, vocab, threads)
    print("\n== 2/3 train an EAGLE-3 head (online features)")
    head_dir = train(run_dir, data, args.train_config, args.epochs, threads)
    print(f"\n== 3/3 decode {args.questions} MT-bench questions (one per category): plain vs EAGLE"
          + (f" vs EAGLE + prompt lookup {args.prompt_lookup}" if args.prompt_lookup else "") + ", greedy, fp32",
          flush=True)
    result = decode_phase(head_dir, args.questions, args.max_new_tokens, args.tree, args.prompt_lookup,
                          args.repeats)
    result["wall_s"] = time.perf_counter() - t0
    write_json(run_dir / "results.json", result)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{os.cpu_count()}-core CPU, fp32"
    card = {"tau": result["tau_mean"], "speedup": result["speedup"], "device": device,
            "benchmark": f"MT-bench first turns ({result['questions']}, one per category), greedy, "
                         f"{args.max_new_tokens} new tokens, median of {args.repeats} paired repeats"}
    if result["machine_note"]:
        card["note"] = result["machine_note"]
    write_json(head_dir / "results.json", card)  # read by the model card
    print(f"\nτ (mean accepted tokens per target forward) = {result['tau_mean']:.2f}; speedup over plain "
          f"decoding = {result['speedup']:.2f}x; outputs identical to plain greedy: {result['all_identical']}")
    if result["machine_note"]:
        print(result["machine_note"])
    if args.prompt_lookup:
        print(f"with prompt lookup ({args.prompt_lookup}) on the head's tree: τ = {result['tau_mean_lookup']:.2f}; "
              f"speedup = {result['speedup_lookup']:.2f}x")
    print(f"head: {head_dir}\n  eaglekit export --head {head_dir} --out {run_dir / 'sglang'} --to sglang\n"
          f"  eaglekit push --head {head_dir} --repo-id USER/smollm2-135m-eagle3 --dry-run")
    print(f"total {result['wall_s'] / 60:.1f} min")
    return 0 if result["all_identical"] else 1
