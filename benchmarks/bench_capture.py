"""Capture benchmark: throughput vs a bare target forward, exact disk per token, flat reader RSS.

    .venv/bin/python benchmarks/bench_capture.py [--conversations 24] [--max-length 512] [--repeats 2]

1. Throughput: the same batches (``compute_features``' length-sorted batching, ``--batch-tokens``) run
   through (a) the bare decoder forward (``target.decoder``, no hooks, no lm_head: what capture computes)
   and (b) the whole capture (hooked forward, bf16 copies, shard assembly, safetensors write + fsync),
   alternated ``--repeats`` times in one process; the best time of each is reported.
2. Disk per token: every shard's header is read back and the ``hidden`` + ``last`` bytes are compared with
   T·(L·H + H)·2 exactly; total file bytes are reported too.
3. Reader RSS: synthetic shards of the SmolLM2 layout (same writer), 1 shard vs 10 shards of equal size;
   a fresh subprocess reads every sample of each and reports its peak RSS (ru_maxrss).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from eaglekit.data_prep.capture import (
    MANIFEST,
    _write_shard,
    capture_features,
    compute_features,
    feature_bytes_per_token,
    shard_name,
    shard_tensors,
)


def sharegpt_samples(tokenizer, n: int, max_length: int) -> list[dict]:
    from eaglekit.assets import sharegpt_items
    from eaglekit.data_prep.conversations import ConversationError, item_messages
    from eaglekit.data_prep.template import tokenize_conversation

    out = []
    for c in sharegpt_items():
        try:
            s = tokenize_conversation(tokenizer, item_messages(c), max_length)
        except ConversationError:
            continue
        if s["loss_mask"].any():
            out.append({"id": c["id"], **s})
        if len(out) == n:
            return out
    return out


@torch.no_grad()
def bare_forward(target, samples, batch_tokens):
    """The decoder forward alone over exactly the batches compute_features builds."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]["input_ids"]))
    pos = 0
    while pos < len(order):
        stop = pos + 1
        while stop < len(order) and len(samples[order[stop]]["input_ids"]) * (stop + 1 - pos) <= batch_tokens:
            stop += 1
        batch = [samples[i]["input_ids"] for i in order[pos:stop]]
        ids = torch.zeros(len(batch), max(map(len, batch)), dtype=torch.long)
        att = torch.zeros_like(ids)
        for b, x in enumerate(batch):
            ids[b, : len(x)], att[b, : len(x)] = x, 1
        target.decoder(input_ids=ids, attention_mask=att, use_cache=False)
        pos = stop


def throughput(target, samples, batch_tokens, repeats) -> dict:
    tokens = sum(len(s["input_ids"]) for s in samples)
    compute_features(target, samples[:2], batch_tokens=batch_tokens)  # warm-up
    bare, cap = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        bare_forward(target, samples, batch_tokens)
        bare.append(time.perf_counter() - t0)
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            capture_features(
                target, samples, d, batch_tokens=batch_tokens, shard_tokens=tokens // 3 + 1, progress=False
            )
            cap.append(time.perf_counter() - t0)
    return {
        "tokens": tokens,
        "bare_s": min(bare),
        "capture_s": min(cap),
        "bare_tok_s": tokens / min(bare),
        "capture_tok_s": tokens / min(cap),
        "ratio": min(bare) / min(cap),
    }


def shard_feature_bytes(path: Path) -> tuple[int, int, int]:
    """(tokens, bytes of hidden+last per the header's data offsets, file size)."""
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
    nbytes = sum(
        v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k in ("hidden", "last")
    )
    return header["input_ids"]["shape"][0], nbytes, path.stat().st_size


def disk_check(target, samples, batch_tokens) -> dict:
    with tempfile.TemporaryDirectory() as d:
        tokens = sum(len(s["input_ids"]) for s in samples)
        m = capture_features(
            target, samples, d, batch_tokens=batch_tokens, shard_tokens=tokens // 4 + 1, progress=False
        )
        rows = [shard_feature_bytes(Path(d) / s["file"]) for s in m["shards"]]
    tokens = sum(r[0] for r in rows)
    bpt = feature_bytes_per_token(target.hidden_size, len(target.default_taps))
    feat = sum(r[1] for r in rows)
    assert feat == tokens * bpt, (feat, tokens * bpt)
    return {
        "tokens": tokens,
        "feature_bytes": feat,
        "expected": tokens * bpt,
        "bytes_per_token": feat / tokens,
        "file_bytes_per_token": sum(r[2] for r in rows) / tokens,
        "shards": len(rows),
    }


def synthetic_capture(
    out: Path, shards: int, samples_per_shard: int, length: int, hidden: int, taps: int
) -> None:
    """Shards in the capture layout with random bf16 features (the reader ignores where they came from)."""
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    entries, first = [], 0
    for j in range(shards):
        items = [
            {
                "input_ids": torch.randint(0, 1000, (length,), generator=g),
                "loss_mask": torch.ones(length, dtype=torch.long),
                "hidden": torch.randn(length, taps * hidden, generator=g).bfloat16(),
                "last": torch.randn(length, hidden, generator=g).bfloat16(),
            }
            for _ in range(samples_per_shard)
        ]
        _write_shard(out / shard_name(j), shard_tensors(items), {"plan_hash": "synthetic", "kind": "eagle3"})
        entries.append(
            {
                "file": shard_name(j),
                "first_sample": first,
                "num_samples": samples_per_shard,
                "num_tokens": samples_per_shard * length,
            }
        )
        first += samples_per_shard
    manifest = {
        "kind": "eagle3",
        "layer_ids": list(range(taps)),
        "hidden_size": hidden,
        "shards": entries,
        "lengths": [length] * first,
        "complete": True,
        "target": {},
    }
    (out / MANIFEST).write_text(json.dumps(manifest))


# VmHWM, not ru_maxrss: Linux carries the parent's peak RSS across fork+exec into ru_maxrss
READ_ALL = (
    "import sys\nfrom eaglekit.data_prep import FeatureDataset\nds = FeatureDataset(sys.argv[1])\n"
    "n = sum(int(ds[i]['hidden'].shape[0]) for i in range(len(ds)))\n"
    "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
    "print(n, hwm)"
)


def reader_rss(workdir: Path, shard_mb: int = 48, length: int = 512) -> dict:
    hidden, taps = 576, 3
    per_sample = length * feature_bytes_per_token(hidden, taps)
    per_shard = max(1, shard_mb * 2**20 // per_sample)
    out = {}
    for n in (1, 10):
        d = workdir / f"rss-{n}"
        synthetic_capture(d, n, per_shard, length, hidden, taps)
        run = subprocess.run(
            [sys.executable, "-c", READ_ALL, str(d)], capture_output=True, text=True, check=True
        )
        tokens, kib = map(int, run.stdout.split())
        out[f"{n}_shards"] = {
            "tokens": tokens,
            "data_mib": round(n * per_shard * per_sample / 2**20),
            "peak_rss_mib": round(kib / 1024, 1),
        }
    out["rss_ratio_10_vs_1"] = out["10_shards"]["peak_rss_mib"] / out["1_shards"]["peak_rss_mib"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["throughput", "disk", "rss"])
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from eaglekit.target import load_target

    report = {
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}, threads {torch.get_num_threads()}"
    }
    if {"throughput", "disk"} - set(args.skip):
        target = load_target(args.target)
        samples = sharegpt_samples(target.tokenizer, args.conversations, args.max_length)
        if "throughput" not in args.skip:
            report["throughput"] = throughput(target, samples, args.batch_tokens, args.repeats)
            print(json.dumps(report["throughput"]), flush=True)
        if "disk" not in args.skip:
            report["disk"] = disk_check(target, samples, args.batch_tokens)
            print(json.dumps(report["disk"]), flush=True)
    if "rss" not in args.skip:
        with tempfile.TemporaryDirectory() as d:
            report["reader_rss"] = reader_rss(Path(d))
        print(json.dumps(report["reader_rss"]), flush=True)
    report["bench_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
