"""Where a llama-server decode step spends its CPU time, by phase: plain decoding beside an EAGLE-3 head.

Each configuration is its own llama-server (one slot, ``--threads``), warmed on one prompt, then sampled by
``perf record -e cpu-clock`` (a software clock: it works in VMs without hardware counters) while it answers
the benched prompts greedily. Every sample is one symbol of llama-server (statically linked ggml, not
stripped); symbols are grouped into phases by name (``PHASES``) and reported as CPU-milliseconds per
generated token, so the head's configurations read directly as "what a generated token costs beyond plain":

- the target's matrix products (its Q4_K/Q5/Q6_K weights) grow with the tokens verified per step;
- the head's matrix products (q8_0 weights; the target file holds no q8_0 tensor — checked below);
- activation quantisation, attention and the other ggml ops, copies (the taps, the KV cache);
- thread synchronisation (ggml's barrier: workers spinning while one finishes) — paid per graph, so per
  llama_decode call, whatever its size;
- graph building and scheduling (paid per llama_decode call as well), sampling, the kernel.

    .venv/bin/python benchmarks/profile_llama_cpp.py --head-gguf runs/qwen15-llama-cpp/bench-humaneval/head/*.gguf \
        --target qwen2.5-coder-1.5b-instruct --prompts 4 --tokens 96 --n-max 1 3 --out benchmarks/results/cpu/profile

Writes ``profile.json`` (samples per symbol and per phase) and prints the table. Needs ``perf`` (linux-tools).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

from eaglekit import assets
from eaglekit.bench.llama_cpp import TokenizerOnly, server_tau
from eaglekit.bench.prompts import load_questions
from eaglekit.engines import llama_cpp

HZ = 1000  # perf samples per CPU-second: one sample = 1 CPU-ms
# first match wins; the order matters (a q8_0 dot product is the head's only where the target has no q8_0)
PHASES = [
    ("kernel", r"^\[k\]"),
    ("q8_0 matmul (the head; any q8_0 tensor of the target)", r"q8_0_q8_0|gemv_q8_0|gemm_q8_0|vec_dot_q8_0|block_q8_0"),
    ("target matmul (q4_K/q5/q6_K)", r"q4_K|q5_K|q6_K|q5_0|q5_1|q4_0|q4_1|iq4|q8_K"),
    ("f32/f16 matmul (embeddings, norms' weights)", r"vec_dot_f16|vec_dot_f32|sgemm|tinyBLAS|mul_mat_f"),
    ("thread sync (ggml barrier, spin)", (r"barrier|ggml_graph_compute_thread|sched_yield|spin|futex|pthread_cond"
                                         r"|gomp|GOMP|omp_")),
    ("activation quantisation", r"quantize_row|quantize_mat|from_float"),
    ("copies (taps, KV, rows)", r"memcpy|memmove|_cpy|_dup|get_rows|set_rows|concat"),
    ("graph build, allocation, scheduling", (r"ggml_new|ggml_graph|ggml_backend_sched|gallocr|llm_graph|llm_build"
                                            r"|ggml_hash|ggml_visit|ggml_view|ggml_reshape|ggml_permute|ggml_cont"
                                            r"|llama_context|llama_kv|llama_memory|ggml_build|ggml_init|ggml_free")),
    ("sampling", r"sampler|sort|softmax_impl|llama_token_data|std::__|common_sampler"),
    ("attention, norms, activations (other ggml ops)", r"ggml_compute_forward|ggml_vec_|ggml_v_|flash_attn|rope"),
    ("allocator", r"malloc|free|_int_|operator new|operator delete"),
]


def phase(symbol: str) -> str:
    for name, pattern in PHASES:
        if re.search(pattern, symbol):
            return name
    return "other"


def by_phase(samples: Counter) -> Counter:
    """Samples per phase from samples per symbol."""
    out = Counter()
    for sym, n in samples.items():
        out[phase(sym)] += n
    return out


def target_has_q8_0(model: Path) -> bool:
    """Whether the target file holds q8_0 tensors (then a q8_0 dot product is not necessarily the head's)."""
    from gguf import GGMLQuantizationType, GGUFReader

    return any(t.tensor_type == GGMLQuantizationType.Q8_0 for t in GGUFReader(str(model)).tensors)


def sampled(pid: int, data: Path, work):
    """(``work()``'s result, perf samples per symbol of process ``pid`` while it ran)."""
    perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", str(HZ), "-p", str(pid), "-o", str(data)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # perf attaches to every thread before the request
    result = work()
    perf.send_signal(signal.SIGINT)
    perf.wait(timeout=60)
    report = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "-q", "--sort", "sym", "-F", "sample,sym"],
                            capture_output=True, text=True, check=True).stdout
    data.unlink(missing_ok=True)
    return result, symbol_samples(report)


def symbol_samples(report: str) -> Counter:
    """Samples per symbol from ``perf report --stdio -q --sort sym -F sample,sym`` (kernel symbols as ``[k] name``)."""
    samples = Counter()
    for line in report.splitlines():
        if m := re.match(r"\s*(\d+)\s+(\[.\])\s+(.*\S)", line):
            samples[("[k] " if m.group(2) == "[k]" else "") + m.group(3)] += int(m.group(1))
    return samples


def profile(server: llama_cpp.Server, prompts, tokens: int, out: Path) -> tuple[Counter, dict]:
    """perf samples per symbol of ``server``'s decode phase over ``prompts`` (each prompt prefilled first,
    outside the window, and kept in the slot's cache), and the answers' summed timings."""
    server.complete(prompts[0], 8)  # warm: pages mapped, buffers allocated
    samples, done = Counter(), []
    for ids in prompts:
        server.complete(ids, 1, cache_prompt=True)  # the prefill, not sampled
        o, s = sampled(server.proc.pid, out.with_suffix(".data"), lambda ids=ids: server.complete(ids, tokens, cache_prompt=True))
        samples.update(s)
        done.append(o)
    timings = {"tokens": sum(len(o.tokens) for o in done),
               "predicted_ms": sum(float(o.timings.get("predicted_ms", 0)) for o in done),
               "draft_n": sum(o.draft_n for o in done), "accepted": sum(o.accepted for o in done),
               "steps": sum(o.steps for o in done), "tau": server_tau(done), "tokens_list": [o.tokens for o in done]}
    return samples, timings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--head-gguf", default=None, help="without it: plain only")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-max", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--out", default="benchmarks/results/cpu/profile")
    args = ap.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("perf is not installed (linux-tools): this profile samples llama-server with it")
    root = llama_cpp.require()
    model = assets.asset_file(args.target)
    tok = TokenizerOnly(args.target)
    prompts = [tok.chat_ids(text)[0].tolist() for _, text in load_questions(args.dataset, args.prompts, "spread")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    confs = {"plain": {}} | {f"head n_max {n}": {"draft": args.head_gguf, "spec_type": "draft-eagle3", "n_max": n,
                                                 "p_min": 0.0} for n in (args.n_max if args.head_gguf else [])}
    results = {}
    for name, kw in confs.items():
        with llama_cpp.Server(model, root=root, threads=args.threads, **kw) as s:
            samples, timings = profile(s, prompts, args.tokens, out / name.replace(" ", "-"))
        results[name] = {"timings": timings, "phases": dict(by_phase(samples)), "top_symbols": samples.most_common(40)}
        print(f"{name}: {timings['tokens']} tokens, {sum(samples.values())} samples", flush=True)
    plain_tokens = results["plain"]["timings"]["tokens_list"]
    names = list(results)
    rows = [p for p, _ in PHASES] + ["other"]
    print("\nCPU-ms per generated token (perf cpu-clock samples, all threads):\n")
    print("| phase | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for p in rows:
        vals = [results[n]["phases"].get(p, 0) * 1000 / HZ / results[n]["timings"]["tokens"] for n in names]
        if any(v >= 0.05 for v in vals):
            print(f"| {p} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    totals = [sum(results[n]["phases"].values()) * 1000 / HZ / results[n]["timings"]["tokens"] for n in names]
    print("| **all (CPU-ms per token)** | " + " | ".join(f"**{v:.1f}**" for v in totals) + " |")
    walls = [results[n]["timings"]["predicted_ms"] / results[n]["timings"]["tokens"] for n in names]
    print("| wall ms per token (server's decode timings) | " + " | ".join(f"{v:.1f}" for v in walls) + " |")
    print("| τ (tokens per target step) | " + " | ".join(
        f"{results[n]['timings']['tau']:.2f}" if n != "plain" else "1" for n in names) + " |")
    print("| identical to plain | " + " | ".join(
        f"{sum(a == b for a, b in zip(results[n]['timings']['tokens_list'], plain_tokens))}/{len(plain_tokens)}"
        for n in names) + " |")
    meta = {"target": args.target, "target_gguf": str(model), "head_gguf": args.head_gguf, "threads": args.threads,
            "dataset": args.dataset, "prompts": args.prompts, "tokens": args.tokens, "hz": HZ,
            "target_has_q8_0": target_has_q8_0(model), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for r in results.values():
        r["timings"].pop("tokens_list")
    (out / "profile.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
