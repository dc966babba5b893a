"""``eaglekit demo``: the main job, end to end, on the embedded default target (SmolLM2-135M-Instruct).

1. prepare: the target regenerates the first turn of a ShareGPT subset (self-distillation) and the
   draft vocabulary is built from its answers          (``eaglekit prepare``)
2. train:   an EAGLE-3 head on those conversations, online features     (``accelerate launch train_head.py``)
3. decode:  one MT-bench question per category, plain greedy decoding, EAGLE decoding and EAGLE + prompt
   lookup side by side in this run; prints a table (τ, speedup, identical) and one answer, and checks
   that every output is token-identical to plain decoding (lossless).

Every step is the same command a user would type (printed before it runs) and resumes: a second run
reuses the regenerated data and the trained head (training is skipped once ``metrics.json`` and
``final/`` exist) and only decodes again. The head is left in
``<run_dir>/head/final``, ready for ``eaglekit export`` / ``eaglekit push``.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from eaglekit import assets, decode
from eaglekit.bench.prompts import load_questions
from eaglekit.decode.lookup import branch_lengths
from eaglekit.decode.plan import auto_plan, parse_tree, use_cpu_linear
from eaglekit.fileio import write_json
from eaglekit.heads import load_head
from eaglekit.target import load_target
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
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", default="auto", help="'auto' or depth,top_k,total_tokens")
    p.add_argument("--prompt-lookup", default="2,5,10",
                   help="also decode with a prompt-lookup branch on the head's tree: N tokens, or one length per "
                        "match of 1, 2, 3 tokens (default 2,5,10, the measured best; 0: off)")


class StepFailed(RuntimeError):
    """A step's command failed; its own error is printed above it."""


def _run(cmd: list[str]) -> None:
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    # one progress bar per phase: ours, not transformers' per model load (HF_HUB_DISABLE_PROGRESS_BARS);
    # the training step runs on the CPU (accelerate launch --cpu): DeepSpeed need not guess, nor say so
    env = {"DS_ACCELERATOR": "cpu", **os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    code = subprocess.run(cmd, check=False, env=env, cwd=ROOT).returncode  # a failure: StepFailed below
    if code:
        how = f"exit status {code}" if code > 0 else f"signal {-code}"
        raise StepFailed(f"the command above failed ({how}); running the demo again resumes where it stopped")


def prepare(run_dir: Path, n: int, regen_tokens: int, draft_vocab: int) -> Path:
    data = run_dir / "data"
    _run([sys.executable, "-m", "eaglekit.cli", "prepare", "--config", str(ROOT / "configs/prepare-smollm2.yaml"),
          f"output_dir={data}", f"num_conversations={n}", "max_turns=1", "capture=false",
          f"draft_vocab_size={draft_vocab}", "regenerate.enabled=true", f"regenerate.max_new_tokens={regen_tokens}",
          "regenerate.max_prompt_tokens=384", "regenerate.batch_size=16"])
    return data


def train(run_dir: Path, data: Path, config: str, epochs: int) -> Path:
    """Train the head (``accelerate launch train_head.py``) unless an earlier run finished it: a rerun of
    the trainer would continue from its last checkpoint and train the last steps again."""
    head = run_dir / "head"
    if (head / "metrics.json").is_file() and (head / "final" / "model.safetensors").is_file():  # written last
        print(f"\nthe head in {head / 'final'} is trained (delete {head} to train it again)", flush=True)
        return head / "final"
    accelerate = Path(sys.executable).with_name("accelerate")
    _run([str(accelerate), "launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
          "--num_cpu_threads_per_process", str(torch.get_num_threads()), "--mixed_precision", "no",
          "--dynamo_backend", "no", str(ROOT / "train_head.py"), "--config", config,
          f"data.conversations={data / 'regenerated.jsonl'}", f"data.draft_vocab={data / 'draft_vocab.safetensors'}",
          "data.num_conversations=0", f"optim.epochs={epochs}", f"output_dir={head}"])
    return head / "final"


def demo_questions(n: int) -> list[tuple[str, str]]:
    """``[(category, text)]``: MT-bench first turns, one per category in turn (the bench's
    ``prompt_order=spread``)."""
    return load_questions("mt-bench", n, order="spread")


def decode_question(target, head, text: str, max_new_tokens: int, tree, lookup=0) -> dict:
    """One question decoded plainly, with the head's tree and (``lookup``) with a prompt-lookup branch on it,
    one after the other; each output compared token for token with plain greedy decoding."""
    ids = target.chat_ids(text)
    plain = decode.generate(target, None, ids, max_new_tokens=max_new_tokens)
    fast = decode.generate(target, head, ids, max_new_tokens=max_new_tokens, tree=tree)
    answer = target.tokenizer.decode(fast.sequences[0, ids.shape[1]:], skip_special_tokens=True).strip()
    row = {"question": text, "tau": fast.stats.tau, "plain_s": plain.stats.total_s, "eagle_s": fast.stats.total_s,
           "new_tokens": fast.stats.new_tokens, "identical": torch.equal(plain.sequences, fast.sequences),
           "acceptance_per_depth": fast.stats.acceptance_per_depth, "answer": answer}
    if lookup:
        both = decode.generate(target, head, ids, max_new_tokens=max_new_tokens, tree=tree, prompt_lookup=lookup)
        row.update(tau_lookup=both.stats.tau, lookup_s=both.stats.total_s,
                   identical_lookup=torch.equal(plain.sequences, both.sequences))
    return row


def decode_side_by_side(target, head, questions: list[tuple[str, str]], max_new_tokens: int, tree,
                        lookup=0) -> dict:
    """Plain vs EAGLE (vs EAGLE + a prompt-lookup branch, ``lookup`` as generate's ``prompt_lookup``) greedy
    decoding of ``questions`` (``[(category, text)]``): per-question rows and the totals."""
    rows = [{"category": category, **decode_question(target, head, text, max_new_tokens, tree, lookup)}
            for category, text in tqdm(questions, desc="decode", unit="question")]
    plain_s = sum(r["plain_s"] for r in rows)
    out = {"questions": len(rows), "tau_mean": sum(r["tau"] for r in rows) / len(rows),
           "speedup": plain_s / sum(r["eagle_s"] for r in rows), "tree": str(tree), "rows": rows,
           "all_identical": all(r["identical"] and r.get("identical_lookup", True) for r in rows)}
    if lookup:
        out.update(prompt_lookup=lookup, tau_mean_lookup=sum(r["tau_lookup"] for r in rows) / len(rows),
                   speedup_lookup=plain_s / sum(r["lookup_s"] for r in rows))
    return out


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def _line(width: int, question: str, category: str, *cells: str) -> str:
    return f"{_clip(question, width):<{width}}  {category:<10}" + "".join(f"  {c:>9}" for c in cells)


def results_table(result: dict, width: int = 36) -> str:
    """One line per question: the question (clipped to ``width``), its category, τ and speedup over plain
    (and with the lookup branch), whether every output was token-identical to plain; then the totals."""
    lookup = "tau_lookup" in result["rows"][0]
    lines = [_line(width, "question", "category", "τ", "speedup", *(("τ +lookup", "speedup") if lookup else ()),
                   "identical")]
    for r in result["rows"]:
        cells = [f"{r['tau']:.2f}", f"{r['plain_s'] / r['eagle_s']:.2f}x"]
        if lookup:
            cells += [f"{r['tau_lookup']:.2f}", f"{r['plain_s'] / r['lookup_s']:.2f}x"]
        same = r["identical"] and r.get("identical_lookup", True)
        lines.append(_line(width, r["question"], r["category"], *cells, "yes" if same else "NO"))
    n = result["questions"]
    same = sum(r["identical"] and r.get("identical_lookup", True) for r in result["rows"])
    cells = [f"{result['tau_mean']:.2f}", f"{result['speedup']:.2f}x"]
    if lookup:
        cells += [f"{result['tau_mean_lookup']:.2f}", f"{result['speedup_lookup']:.2f}x"]
    lines.append(_line(width, f"all {n} (mean τ, total time)", "", *cells, f"{same}/{n}"))
    return "\n".join(lines)


def decode_phase(head_dir: Path, questions: int, max_new_tokens: int, tree, lookup=0) -> dict:
    """Load the target and the trained head, pick the tree, decode, print the table and one answer."""
    hf_logging.disable_progress_bar()  # no weight-loading bar: the decode phase has its own
    target = load_target(assets.DEFAULT_TARGET)
    head = load_head(head_dir, target)
    use_cpu_linear("packed", target, head)  # decoding only: oneDNN pre-packed weights, plain and EAGLE alike
    tree = parse_tree(tree)
    if tree == "auto":  # draft with the best measured tree even where plain would win, to show the head's τ
        plan = auto_plan(target, head)
        tree = plan.spec
        print(f"tree='auto' on this device: {tree}, expected {plan.expected_tokens_per_s:.1f} tokens/s vs "
              f"plain {plan.plain_tokens_per_s:.1f}" + ("" if plan.drafting_pays else " (`eaglekit generate "
              "tree=auto` would decode without drafting here; the demo drafts anyway to measure the head)"),
              flush=True)
    result = decode_side_by_side(target, head, demo_questions(questions), max_new_tokens, tree, lookup)
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
    print(f"== 1/3 prepare: regenerate {args.conversations} ShareGPT first turns with the target")
    data = prepare(run_dir, args.conversations, args.regen_tokens, vocab)
    print("\n== 2/3 train an EAGLE-3 head (online features)")
    head_dir = train(run_dir, data, args.train_config, args.epochs)
    print(f"\n== 3/3 decode {args.questions} MT-bench questions (one per category): plain vs EAGLE"
          + (f" vs EAGLE + prompt lookup {args.prompt_lookup}" if args.prompt_lookup else "") + ", greedy, fp32",
          flush=True)
    result = decode_phase(head_dir, args.questions, args.max_new_tokens, args.tree, args.prompt_lookup)
    result["wall_s"] = time.perf_counter() - t0
    write_json(run_dir / "results.json", result)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{os.cpu_count()}-core CPU, fp32"
    card = {"tau": result["tau_mean"], "speedup": result["speedup"], "device": device,
            "benchmark": f"MT-bench first turns ({result['questions']}, one per category), greedy, "
                         f"{args.max_new_tokens} new tokens"}
    write_json(head_dir / "results.json", card)  # read by the model card
    print(f"\nτ (mean accepted tokens per target forward) = {result['tau_mean']:.2f}; speedup over plain "
          f"decoding = {result['speedup']:.2f}x; outputs identical to plain greedy: {result['all_identical']}")
    if args.prompt_lookup:
        print(f"with prompt lookup ({args.prompt_lookup}) on the head's tree: τ = {result['tau_mean_lookup']:.2f}; "
              f"speedup = {result['speedup_lookup']:.2f}x")
    print(f"head: {head_dir}\n  eaglekit export --head {head_dir} --out {run_dir / 'sglang'} --to sglang\n"
          f"  eaglekit push --head {head_dir} --repo-id USER/smollm2-135m-eagle3 --dry-run")
    print(f"total {result['wall_s'] / 60:.1f} min")
    return 0 if result["all_identical"] else 1
