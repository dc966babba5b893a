"""Hook capture vs vLLM capture (``capture_engine=vllm``) of the same samples on this machine: tokens/s
(loading and the server's start apart), peak RSS, and how close the engine's bf16 features are to the hooks'.

    .venv/bin/python benchmarks/bench_capture_engine.py smollm2-135m-instruct --conversations 32 --max-length 512

Both run fp32 with ``--threads`` threads: the hooks batch by length up to ``--batch-tokens``; the server
eaglekit starts takes one sequence at a time (vllm_cpu.Server). The server's RSS is its whole process tree,
sampled every 0.2 s, and includes the KV cache it reserves up front (VLLM_CPU_KVCACHE_SPACE, 2 GiB).
"""
from __future__ import annotations

import argparse
import resource
import tempfile
import threading
import time

import psutil
import torch

from eaglekit.data_prep.capture import compute_features, resolve_taps
from eaglekit.data_prep.engine import VllmEngine, engine_features, engine_layer_ids
from eaglekit.data_prep.prepare import PrepareConfig, load_conversations
from eaglekit.data_prep.template import tokenize_conversations
from eaglekit.target import load_target, resolve


def tree_peak_rss(pid: int, peak: list[int]) -> None:
    while True:
        try:
            p = psutil.Process(pid)
            peak[0] = max(peak[0], sum(c.memory_info().rss for c in [p, *p.children(recursive=True)]))
        except psutil.Error:
            return
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target = load_target(a.target)
    convs = load_conversations(PrepareConfig(num_conversations=a.conversations))
    samples, _ = tokenize_conversations(target.tokenizer, convs, a.max_length, progress=False)
    tokens = sum(len(s["input_ids"]) for s in samples)
    taps = resolve_taps(target, "eagle3", None)
    print(f"{a.target}: {len(samples)} samples, {tokens} tokens, {a.threads} threads, taps {list(taps)}")
    t0 = time.perf_counter()
    hooks = compute_features(target, samples, "eagle3", taps, a.batch_tokens)
    th = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"hooks: {th:.1f} s, {tokens / th:.0f} tok/s, peak RSS {rss:.2f} GiB (this process)")
    peak = [0]
    with tempfile.TemporaryDirectory() as storage:
        t0 = time.perf_counter()
        with VllmEngine(resolve(a.target)[0], engine_layer_ids(taps, target.num_layers), storage,
                        max_model_len=a.max_length + 1, threads=a.threads) as engine:
            start = time.perf_counter() - t0
            threading.Thread(target=tree_peak_rss, args=(engine.server.proc.pid, peak), daemon=True).start()
            t0 = time.perf_counter()
            items = engine_features(engine, target, taps)(samples)
            tv = time.perf_counter() - t0
    print(f"vllm: start {start:.0f} s, capture {tv:.1f} s, {tokens / tv:.0f} tok/s, "
          f"server peak RSS {peak[0] / 2**30:.2f} GiB")
    same = all(torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
               for x, y in zip(items, hooks, strict=True))
    print(f"tokens and masks equal: {same}")
    for key in ("taps", "last"):
        e = torch.cat([x[key].float() for x in items])
        h = torch.cat([x[key].float() for x in hooks])
        ok = torch.allclose(e, h, rtol=2**-7, atol=2e-3)
        print(f"{key}: max |diff| {(e - h).abs().max().item()}, bit-equal {(e == h).float().mean().item():.4f}, "
              f"within rtol=2^-7 atol=2e-3: {ok}")


if __name__ == "__main__":
    main()
