"""Training benchmarks: teacher memory with a large vocabulary, and a CPU training run's τ_sim.

    python benchmarks/bench_train.py teacher-memory              # V=151,936 (Qwen2.5), chunked vs naive
    python benchmarks/bench_train.py train --config configs/smollm2-135m-eagle3.yaml [key=value ...]
    python benchmarks/bench_train.py step-speed --config configs/smollm2-135m-eagle3-long.yaml  # bf16 x teacher cache

``teacher-memory`` runs each variant in a fresh subprocess and reports the peak RSS growth of one
loss forward+backward over the same inputs (student logits over the draft vocab, ``last`` hidden
states, the frozen lm_head), so allocator state from one variant cannot hide another's peak.
``train`` runs train_head.py's trainer and prints the held-out τ_sim, tokens/s and peak memory.
``step-speed`` times one loss forward+backward of the config's head on a [batch, seq] micro-batch (random
features: the cost does not depend on their values) with bf16 autocast and the per-batch teacher cache
each on and off, median of ``--repeats``, all variants in one process side by side.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so the next reading is this phase's own peak."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def teacher_variant(variant: str, tokens: int, hidden: int, vocab: int, draft: int, chunk: int) -> dict:
    """One loss forward+backward; returns the peak memory it added over its inputs (MB)."""
    import torch

    from eaglekit.heads.objectives import Teacher, soft_cross_entropy, teacher_probs

    torch.manual_seed(0)
    last = torch.randn(1, tokens, hidden).bfloat16()
    weight = torch.randn(vocab, hidden).bfloat16() * 0.05
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab)[:draft]] = True
    student = torch.randn(1, tokens, draft, requires_grad=True)
    mask = torch.ones(1, tokens)
    teacher = Teacher.build(weight, t2d)  # the [Vd, H] slice is made once per run, not per batch
    base = _status_mb("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    if variant == "naive":  # the full [B, S, V] fp32 teacher, as trainers did before chunking
        logits = (last @ weight.T).float()  # same bf16 matmul as the chunked path, then fp32
        top = logits.argmax(-1)
        p = torch.softmax(logits[..., t2d], dim=-1)
        keep = mask * t2d[top].float()
        loss = -(keep[..., None] * p * torch.log_softmax(student, -1)).sum()
    else:
        top = teacher.targets(last, chunk)
        keep = mask * (top >= 0).float()
        if variant == "chunked-cached":  # draft-vocab teacher kept for the batch (what small Vd uses)
            loss = soft_cross_entropy(student, teacher_probs(last, teacher.draft_weight, chunk), None, keep, chunk)
        else:  # recomputed per chunk in forward and backward
            loss = soft_cross_entropy(student, last, teacher.draft_weight, keep, chunk)
    loss.backward()
    return {"variant": variant, "peak_mb": _status_mb("VmHWM") - base, "seconds": time.perf_counter() - t0,
            "loss": float(loss) / tokens}


def teacher_memory(args) -> dict:
    rows = []
    for variant in ("naive", "chunked", "chunked-cached"):
        cmd = [sys.executable, __file__, "_variant", variant, str(args.tokens), str(args.hidden), str(args.vocab),
               str(args.draft), str(args.chunk)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        rows.append(json.loads(out))
    naive = rows[0]["peak_mb"]
    fp32_bsv = args.tokens * args.vocab * 4 / 2**20
    print(f"tokens={args.tokens} H={args.hidden} V={args.vocab} Vd={args.draft} chunk={args.chunk}; "
          f"one [B,S,V] fp32 tensor = {fp32_bsv:.0f} MB")
    for r in rows:
        print(f"  {r['variant']:15s} peak +{r['peak_mb']:8.0f} MB  ratio {r['peak_mb'] / naive:5.3f}  "
              f"{r['seconds']:6.1f} s  loss/token {r['loss']:.5f}")
    return {"rows": rows, "fp32_bsv_mb": fp32_bsv}


def train(args) -> dict:
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import train as run_training

    cfg = load_train_config(args.config, args.overrides)
    t0 = time.perf_counter()
    final = run_training(cfg)
    final["wall_seconds"] = time.perf_counter() - t0
    print(json.dumps(final, indent=1))
    return final


def step_speed(args) -> dict:
    import statistics

    import torch

    from eaglekit.heads import HeadConfig, build_head
    from eaglekit.heads.objectives import Teacher, TTTModel
    from eaglekit.target import load_target_from
    from eaglekit.train.config import load_train_config

    torch.manual_seed(0)
    cfg = load_train_config(args.config, ["data.conversations=unused", *args.overrides])
    target = load_target_from(cfg.target)
    hc = HeadConfig.from_target(target, kind=cfg.head.kind, num_layers=cfg.head.num_layers,
                                draft_vocab_size=cfg.head.draft_vocab_size)  # EAGLE-1: the whole vocabulary
    head = build_head(hc, target, dtype=torch.float32)
    V, H, taps = hc.target_vocab_size, hc.hidden_size, len(hc.aux_layer_ids)
    Vd = hc.draft_vocab_size
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:Vd] = True
    model = TTTModel(head, Teacher.build(target.lm_head.weight, t2d), cfg.loss)
    B, S = args.batch, args.seq
    batch = {"input_ids": torch.randint(0, Vd, (B, S)), "loss_mask": torch.ones(B, S),
                 "last": torch.randn(B, S, H).bfloat16(), "top": torch.randint(0, Vd, (B, S))}
    if taps:
        batch["taps"] = torch.randn(B, S, taps * H).bfloat16()

    def once(bf16: bool) -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = model(**batch, steps=cfg.loss.ttt_steps, train=False)  # no noise, as before
        loss.backward()
        return time.perf_counter() - t0

    rows = []
    for bf16 in (False, True):
        for cache_mb in (0.0, 1e6):
            cfg.loss.cache_teacher_mb = cache_mb
            once(bf16)  # warm-up
            sec = statistics.median(once(bf16) for _ in range(args.repeats))
            rows.append({"bf16": bf16, "teacher_cache": cache_mb > 0, "seconds": sec, "tokens_per_s": B * S / sec})
    print(f"{cfg.head.kind} K={cfg.loss.ttt_steps} Vd={Vd} batch {B}x{S}, threads {torch.get_num_threads()}, "
          f"median of {args.repeats}")
    for r in rows:
        print(f"  bf16={r['bf16']!s:5} teacher_cache={r['teacher_cache']!s:5} {r['seconds']:6.2f} s/step "
              f"{r['tokens_per_s']:7.0f} tok/s  {r['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x")
    return {"rows": rows}


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "_variant":
        v, tokens, hidden, vocab, draft, chunk = argv[1], *map(int, argv[2:7])
        print(json.dumps(teacher_variant(v, tokens, hidden, vocab, draft, chunk)))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("teacher-memory")
    m.add_argument("--tokens", type=int, default=2048)
    m.add_argument("--hidden", type=int, default=896)
    m.add_argument("--vocab", type=int, default=151936)
    m.add_argument("--draft", type=int, default=32000)
    m.add_argument("--chunk", type=int, default=512)
    t = sub.add_parser("train")
    t.add_argument("--config", required=True)
    t.add_argument("overrides", nargs="*", default=[])
    s = sub.add_parser("step-speed")
    s.add_argument("--config", required=True)
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--seq", type=int, default=600)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("overrides", nargs="*", default=[])
    args = p.parse_args(argv)
    {"teacher-memory": teacher_memory, "train": train, "step-speed": step_speed}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
