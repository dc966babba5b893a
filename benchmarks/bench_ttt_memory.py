"""Training memory and time per token of the EAGLE-3 TTT loss against sequence length, on a tiny head.

Each length runs in a fresh process (the kernel's high-water mark, VmHWM, never goes down): one batch of
one sequence, ``--ttt`` steps, forward and backward of ``heads.objectives.ttt_loss``, a warm-up pass first.
Reported: peak RSS above the process's RSS before the first pass, seconds per pass, and the size the
largest TTT attention mask would have (``heads.cache.ttt_mask``: [S, (k+1)·S] floats at step k). The unroll
used to build and keep those masks (memory quadratic in S); ``heads.ttt_attention`` needs none, so run this
file from an earlier checkout (PYTHONPATH) for the "before" numbers.

    python benchmarks/bench_ttt_memory.py --lengths 512 1024 2048 4096 --ttt 3
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def vm(field: str) -> int:
    """``field`` (VmHWM, VmRSS) of this process in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_one(S: int, ttt: int, hidden: int, vocab: int) -> dict:
    import torch
    from torch import nn

    from eaglekit.heads.config import HeadConfig
    from eaglekit.heads.eagle3 import Eagle3Head
    from eaglekit.train.config import LossConfig
    from eaglekit.heads.objectives import Teacher, ttt_loss

    torch.manual_seed(0)
    heads = max(1, hidden // 16)
    cfg = HeadConfig(kind="eagle3", hidden_size=hidden, target_vocab_size=vocab, draft_vocab_size=vocab,
                     target_num_layers=4, aux_layer_ids=[0, 1, 2], num_attention_heads=heads,
                     num_key_value_heads=heads, head_dim=16, intermediate_size=2 * hidden,
                     max_position_embeddings=S + ttt + 8)
    head = Eagle3Head(cfg)
    head._borrowed["embed_tokens"] = nn.Embedding(vocab, hidden)  # what bind() lends from a target
    teacher = Teacher.build(torch.randn(vocab, hidden), None)
    loss = LossConfig(ttt_steps=ttt, cache_teacher_mb=0)
    batch = {"input_ids": torch.randint(0, vocab, (1, S)), "loss_mask": torch.ones(1, S, dtype=torch.long),
             "last": torch.randn(1, S, hidden), "taps": torch.randn(1, S, 3 * hidden)}
    base = vm("VmRSS")
    times = []
    for _ in range(2):  # the first is a warm-up
        t0 = time.perf_counter()
        total, _ = ttt_loss(head, teacher, batch, loss, steps=ttt)
        total.backward()
        times.append(time.perf_counter() - t0)
    mask_mb = S * ttt * S * 4 / 2**20  # the last step's mask, fp32, on the mask path
    return {"seq_len": S, "ttt": ttt, "peak_rss_mb": (vm("VmHWM") - base) / 2**20, "seconds": times[-1],
            "tokens_per_s": S / times[-1], "largest_mask_mb": mask_mb}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure one length in this process
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(a.one, a.ttt, a.hidden, a.vocab)))
        return
    rows = []
    for S in a.lengths:
        out = subprocess.run([sys.executable, __file__, "--one", str(S), "--ttt", str(a.ttt), "--hidden",
                              str(a.hidden), "--vocab", str(a.vocab)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"S={S:5d}  peak RSS +{r['peak_rss_mb']:8.1f} MB  {r['seconds']:6.2f} s/pass  "
              f"{r['tokens_per_s']:8.0f} tok/s  largest mask {r['largest_mask_mb']:7.1f} MB", flush=True)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
