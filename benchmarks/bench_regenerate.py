"""Regeneration throughput: in-process HF batched ``generate`` vs a local ``transformers serve`` endpoint.

    .venv/bin/python benchmarks/bench_regenerate.py [--conversations 16] [--max-tokens 32] [--batch-size 8]
        [--concurrency 4] [--threads 2] [--serve-args "--continuous-batching"]

The same ShareGPT first turns (``max_turns=1``), the same ``max_new_tokens``, greedy, SmolLM2-135M-Instruct
in fp32 on the CPU, the same torch thread count for both (the server's through OMP_NUM_THREADS). Each path
writes its own regenerated jsonl through ``eaglekit.data_prep.regenerate``; the time is the whole call
(the server's start-up is timed apart). Also printed: answer tokens/s and how many answers are identical
between the two paths (batched left padding can flip a near-tie).
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
import time
from pathlib import Path

import torch

from eaglekit.assets import model_dir
from eaglekit.data_prep.endpoint import TransformersServe
from eaglekit.data_prep.prepare import PrepareConfig, load_conversations
from eaglekit.data_prep.regenerate import RegenerateConfig, regenerate
from eaglekit.target import load_target

MODEL = "smollm2-135m-instruct"


def answers(path: Path) -> list[str]:
    return [
        next((m["content"] for m in json.loads(line)["messages"] if m["role"] == "assistant"), "")
        for line in path.read_text().splitlines()
    ]


def timed_regenerate(target, convs, path: Path, cfg: RegenerateConfig) -> float:
    t0 = time.perf_counter()
    regenerate(target, convs, path, cfg, progress=False)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8, help="in-process generate batch")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight to the server")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, both paths")
    ap.add_argument("--serve-args", default="", help="extra `transformers serve` options")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    convs = load_conversations(PrepareConfig(num_conversations=args.conversations, max_turns=1))
    target = load_target(MODEL)
    common = {"max_new_tokens": args.max_tokens, "max_prompt_tokens": args.max_prompt_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        hf_path, srv_path = Path(tmp) / "hf.jsonl", Path(tmp) / "serve.jsonl"
        hf_s = timed_regenerate(
            target, convs, hf_path, RegenerateConfig(batch_size=args.batch_size, **common)
        )
        server = TransformersServe(
            model_dir(MODEL), threads=args.threads, extra_args=shlex.split(args.serve_args)
        )
        t0 = time.perf_counter()
        with server:
            start_s = time.perf_counter() - t0
            cfg = RegenerateConfig(endpoint=server.url, concurrency=args.concurrency, **common)
            srv_s = timed_regenerate(target, convs, srv_path, cfg)
        hf, srv = answers(hf_path), answers(srv_path)
    tokens = [
        sum(len(target.tokenizer(a, add_special_tokens=False)["input_ids"]) for a in x) for x in (hf, srv)
    ]
    same = sum(a == b for a, b in zip(hf, srv))
    n = len(convs)
    print(f"{n} ShareGPT first turns, max_tokens={args.max_tokens}, greedy, {args.threads} torch thread(s)")
    print("| path | settings | time (s) | conversations/s | answer tokens/s |")
    print("|---|---|---|---|---|")
    print(
        f"| in-process HF `generate` | batch {args.batch_size} | {hf_s:.1f} | {n / hf_s:.3f} | {tokens[0] / hf_s:.1f} |"
    )
    print(
        f"| `transformers serve` {args.serve_args} | concurrency {args.concurrency} (start-up {start_s:.1f} s apart) "
        f"| {srv_s:.1f} | {n / srv_s:.3f} | {tokens[1] / srv_s:.1f} |"
    )
    print(f"identical answers: {same}/{n}")


if __name__ == "__main__":
    main()
