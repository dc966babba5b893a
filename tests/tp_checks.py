"""Checks run inside a torchrun launch with a tensor-parallel target (launched by tests/test_tensor_parallel.py).

    torchrun --nproc_per_node N tests/tp_checks.py OUT CHECK [CHECK...]

Each check writes what it found under OUT (rank-suffixed JSON, tensors from the first rank); the test
compares them with one process. Checks:
  capture TARGET SAMPLES.json   fp32 features of the samples (compute_features) and a bf16 capture (shards)
  decode TARGET PROMPT          greedy speculative decoding (untrained EAGLE-3 head tree + prompt lookup)
                                against the same split target's own greedy decoding (transformers generate)
  prepare OVERRIDES.json        eaglekit prepare (run_prepare) with the given key=value overrides
  train OVERRIDES.json          online training (eaglekit.train) with the given key=value overrides
TARGET is a model name or folder; every check loads it with target.tp_size from TP (environment, default 2).
"""
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "decode")]
TP = int(os.environ.get("TP", "2"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def split_target(name: str):
    """``name`` split TP ways, loaded once per launch (the capture and decode checks share it)."""
    from eaglekit.target import load_target

    if name not in _TARGETS:
        _TARGETS[name] = load_target(name, tp_size=TP, only_tp=True)
    return _TARGETS[name]


_TARGETS: dict = {}


def dump(out: Path, name: str, record: dict) -> None:
    (out / f"{name}-rank{rank()}.json").write_text(json.dumps(record))


def check_capture(out: Path, name: str, samples_file: str) -> None:
    from eaglekit.data_prep.capture import capture_features, compute_features

    target = split_target(name)
    samples = json.loads(Path(samples_file).read_text())
    items = compute_features(target, samples, dtype=torch.float32)
    if rank() == 0:
        torch.save([{k: v for k, v in it.items()} for it in items], out / "features-tp.pt")
    manifest = capture_features(target, samples, out / "capture", shard_tokens=64, progress=False)
    dump(out, "capture", {"layout": [target.layout.dp_rank, target.layout.tp_rank], "complete": manifest["complete"],
                          "lm_head_weight": type(target.model.get_output_embeddings().weight).__name__,
                          "borrowed_weight": type(target.lm_head.weight).__name__})


def check_decode(out: Path, name: str, prompt: str) -> None:
    from test_decode_core import tiny_head
    from test_decode_real import assert_same_or_near_tie

    from eaglekit.decode import generate
    from eaglekit.decode.tree import TreeSpec

    target = split_target(name)
    ids = target.chat_ids(prompt)
    n = 16
    ref = target.model.generate(ids, max_new_tokens=n, do_sample=False, num_beams=1, repetition_penalty=1.0,
                                temperature=None, top_p=None, top_k=None)
    head = tiny_head(target, draft_vocab=min(target.vocab_size, 4096), seed=0)
    got = generate(target, head, ids, n, tree=TreeSpec(3, 4, 10), prompt_lookup=(2, 5, 10))
    ties = assert_same_or_near_tie(target, ref, got.sequences, f"tp={TP}")
    dump(out, "decode", {"same": bool(torch.equal(ref, got.sequences)), "near_ties": ties,
                         "tokens": got.sequences[0].tolist(), "tau": float(got.stats.tau)})


def check_prepare(out: Path, overrides_file: str) -> None:
    from eaglekit.config import load_config
    from eaglekit.data_prep.prepare import PrepareConfig, run_prepare

    overrides = json.loads(Path(overrides_file).read_text()) + [f"target.tp_size={TP}"]
    dump(out, "prepare", run_prepare(load_config(PrepareConfig, None, overrides)))


def check_train(out: Path, overrides_file: str) -> None:
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import train

    overrides = json.loads(Path(overrides_file).read_text()) + [f"target.tp_size={TP}"]
    metrics = train(load_train_config(None, overrides))
    dump(out, "train", {"processes": metrics.get("processes")})


def main() -> None:
    out, args = Path(sys.argv[1]), sys.argv[2:]
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    while args:
        check, *args = args
        start = time.perf_counter()
        if check == "capture":
            check_capture(out, args.pop(0), args.pop(0))
        elif check == "decode":
            check_decode(out, args.pop(0), args.pop(0))
        elif check == "prepare":
            check_prepare(out, args.pop(0))
        elif check == "train":
            check_train(out, args.pop(0))
        else:
            raise SystemExit(f"unknown check {check!r}")
        print(f"[tp_checks rank {rank()}] {check}: {time.perf_counter() - start:.1f} s", flush=True)
        if dist.is_initialized():  # a training run ends its process group (accelerate's end_training): last
            dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo's threads can hang it


if __name__ == "__main__":
    main()
