"""Training memory and time per token of the EAGLE-3 TTT loss against sequence length.

Each length runs in a fresh process (the kernel's high-water mark, VmHWM, never goes down): one batch of
one sequence, ``--ttt`` steps, forward and backward of ``heads.objectives.ttt_loss``, a warm-up pass first.
Reported: peak RSS above the process's RSS before the first pass, seconds per pass (median of
``--repeats``), and the size the largest TTT attention mask would have (``heads.layers.ttt_mask``: [S, (k+1)·S]
floats at step k). The unroll used to build and keep those masks (memory quadratic in S);
``heads.ttt_attention`` needs none, so run this file from an earlier checkout (PYTHONPATH) for the
"before" numbers. ``--shape smollm2`` is a SmolLM2-135M-sized head (H 576, 9 heads / 3 KV heads of 64,
MLP 1536, 49,152-token vocabulary, 4,096-token draft vocabulary, random weights); ``tiny`` is H 64.

``--attention`` times the TTT attention alone (one step-k call, forward + backward, in one process, median
of ``--repeats``): the old mask path (SDPA under ``ttt_mask``), the chunked softmax and the CPU flash path.

    python benchmarks/bench_ttt_memory.py --shape smollm2 --lengths 512 1024 2048 4096 8192 --ttt 3
    python benchmarks/bench_ttt_memory.py --shape smollm2 --attention --lengths 512 1024 2048
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def vm(field: str) -> int:
    """``field`` (VmHWM, VmRSS) of this process in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


SHAPES = {  # hidden, attention heads, KV heads, head dim, MLP, target vocab, draft vocab
    "tiny": (64, 4, 4, 16, 128, 512, 512),
    "smollm2": (576, 9, 3, 64, 1536, 49152, 4096),  # SmolLM2-135M's config.json; draft vocab as its configs
}


def build(S: int, ttt: int, shape: str):
    """A random EAGLE-3 head of ``shape``, its teacher and one batch of S tokens."""
    import torch
    from torch import nn

    from eaglekit.heads.config import HeadConfig
    from eaglekit.heads.eagle3 import Eagle3Head
    from eaglekit.heads.objectives import Teacher

    torch.manual_seed(0)
    hidden, heads, kv, dim, mlp, vocab, draft = SHAPES[shape]
    cfg = HeadConfig(kind="eagle3", hidden_size=hidden, target_vocab_size=vocab, draft_vocab_size=draft,
                     target_num_layers=4, aux_layer_ids=[0, 1, 2], num_attention_heads=heads,
                     num_key_value_heads=kv, head_dim=dim, intermediate_size=mlp,
                     max_position_embeddings=S + ttt + 8)
    head = Eagle3Head(cfg)
    head._borrowed["embed_tokens"] = nn.Embedding(vocab, hidden).requires_grad_(False)  # bind() lends the target's, frozen
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab)[:draft]] = True
    if draft < vocab:
        head.set_draft_vocab(t2d.nonzero().squeeze(1) - torch.arange(draft), t2d)
    teacher = Teacher.build(torch.randn(vocab, hidden), t2d if draft < vocab else None)
    batch = {"input_ids": torch.randint(0, vocab, (1, S)), "loss_mask": torch.ones(1, S, dtype=torch.long),
             "last": torch.randn(1, S, hidden), "taps": torch.randn(1, S, 3 * hidden)}
    return head, teacher, batch


def run_one(S: int, ttt: int, shape: str, repeats: int) -> dict:
    import statistics

    from eaglekit.heads.objectives import ttt_loss
    from eaglekit.train.config import LossConfig

    head, teacher, batch = build(S, ttt, shape)
    loss = LossConfig(ttt_steps=ttt, cache_teacher_mb=0)
    base = vm("VmRSS")
    times = []
    for _ in range(1 + repeats):  # the first is a warm-up
        t0 = time.perf_counter()
        total, _ = ttt_loss(head, teacher, batch, loss, steps=ttt)
        total.backward()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times[1:])
    mask_mb = S * ttt * S * 4 / 2**20  # the last step's mask, fp32, on the mask path
    return {"seq_len": S, "ttt": ttt, "shape": shape, "peak_rss_mb": (vm("VmHWM") - base) / 2**20,
            "seconds": seconds, "tokens_per_s": S / seconds, "largest_mask_mb": mask_mb}


def time_attention(S: int, steps: int, shape: str, repeats: int) -> dict:
    """ms per step-``steps`` attention call (forward + backward) of each implementation, median of ``repeats``."""
    import statistics

    import torch
    import torch.nn.functional as F

    from eaglekit.heads import ttt_attention as ta
    from eaglekit.heads.layers import ttt_mask

    def masked(q, keys, values):  # the old path: SDPA over every step's keys under ttt_mask
        rep = q.shape[1] // keys[0].shape[1]
        k, v = (torch.cat(t, dim=2).repeat_interleave(rep, dim=1) for t in (keys, values))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=ttt_mask(S, len(keys) - 1, q.dtype))

    def flash(use):
        def attend(q, keys, values):
            ta.USE_CPU_FLASH = use
            return ta.ttt_attention(q, keys, values)
        return attend

    _, heads, kv, dim, *_ = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, S, dim, generator=gen).requires_grad_()
    ks = [torch.randn(1, kv, S, dim, generator=gen).requires_grad_() for _ in range(steps + 1)]
    vs = [torch.randn(1, kv, S, dim, generator=gen).requires_grad_() for _ in range(steps + 1)]
    w = torch.randn(q.shape, generator=gen)
    out = {}
    for name, attend in (("masked", masked), ("chunked", flash(False)), ("cpu_flash", flash(True))):
        times = []
        for _ in range(1 + repeats):
            t0 = time.perf_counter()
            torch.autograd.grad((attend(q, ks, vs) * w).sum(), [q, *ks, *vs])
            times.append(time.perf_counter() - t0)
        out[name] = 1e3 * statistics.median(times[1:])
    return {"seq_len": S, "step": steps, **{f"{n}_ms": v for n, v in out.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--repeats", type=int, default=1, help="timed passes after the warm-up (median)")
    ap.add_argument("--attention", action="store_true", help="time the TTT attention alone, each path")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure one length in this process
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(a.one, a.ttt, a.shape, a.repeats)))
        return
    rows = []
    for S in a.lengths:
        if a.attention:
            for k in range(1, a.ttt):  # the steps with diagonal keys that a TTT loss of a.ttt steps runs
                rows.append(time_attention(S, k, a.shape, a.repeats))
                print(" ".join(f"{n}={v:.1f}" if isinstance(v, float) else f"{n}={v}" for n, v in rows[-1].items()),
                      flush=True)
            continue
        out = subprocess.run([sys.executable, __file__, "--one", str(S), "--ttt", str(a.ttt), "--shape", a.shape,
                              "--repeats", str(a.repeats)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"S={S:5d}  peak RSS +{r['peak_rss_mb']:8.1f} MB  {r['seconds']:6.2f} s/pass  "
              f"{r['tokens_per_s']:8.0f} tok/s  largest mask {r['largest_mask_mb']:7.1f} MB", flush=True)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
