"""Checks run inside a torchrun launch with a tensor-parallel target (launched by tests/target/test_tensor_parallel.py).

    torchrun --nproc_per_node N tests/tp_checks.py OUT CHECK [CHECK...]
    accelerate launch --config_file configs/accelerate/cpu-zero2-2proc.yaml tests/tp_checks.py OUT ...  # ZeRO-2

Each check writes what it found under OUT (rank-suffixed JSON, tensors from the first rank); the test
compares them with one process. Checks:
  capture TARGET SAMPLES.json   fp32 features of the samples (compute_features) and a bf16 capture (shards)
  decode TARGET PROMPT          greedy speculative decoding (untrained EAGLE-3 head tree + prompt lookup)
                                against the same split target's own greedy decoding (transformers generate)
  regenerate TARGET CONVS.jsonl in-process regeneration (data_prep.regenerate) on the split target: greedy
                                into regen-greedy/, the same resumed after a kill (its first batch and a torn
                                line kept) into regen-resumed/ (REGEN_GREEDY below)
  generate OVERRIDES.json       the ``eaglekit generate`` CLI with the given key=value overrides plus
                                tp_size=TP (its target: the launch's split one, loaded once); what each
                                rank printed goes to generate-rank*.json
  bench OVERRIDES.json          the same for ``eaglekit bench`` (its report: where out= says)
  prepare OVERRIDES.json        eaglekit prepare (run_prepare) with the given key=value overrides
  train OVERRIDES.json          online training (eaglekit.train) with the given key=value overrides (DDP, or
                                DeepSpeed when launched by accelerate launch with a DeepSpeed config)
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
    from eaglekit.decode.drafters import TreeSpec

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


REGEN_GREEDY = {"enabled": True, "max_new_tokens": 8, "batch_size": 2, "sort_window": 1, "max_prompt_tokens": 256,
                "seed": 0}


def check_regenerate(out: Path, name: str, conversations_file: str) -> None:
    from eaglekit.data_prep import regenerate as regen

    target = split_target(name)
    convs = [json.loads(line) for line in Path(conversations_file).read_text().splitlines()]
    generated = []  # the first conversation of each batch this process generated
    batch = regen.regenerate_batch

    def counted(t, cs, cfg, seed):
        generated.append(cs[0]["id"])
        return batch(t, cs, cfg, seed)

    regen.regenerate_batch = counted
    runs = {}
    try:
        for run in ("greedy", "resumed"):
            path = out / f"regen-{run}" / "regenerated.jsonl"
            if run == "resumed" and rank() == 0:  # a kill after the first batch, in the middle of a line
                path.parent.mkdir(parents=True)
                lines = (out / "regen-greedy/regenerated.jsonl").read_bytes().split(b"\n")
                n = REGEN_GREEDY["batch_size"]
                path.write_bytes(b"\n".join(lines[:n]) + b"\n" + lines[n][:20])
            dist.barrier()
            generated.clear()
            regen.regenerate(target, convs, path, regen.RegenerateConfig(**REGEN_GREEDY), progress=False)
            runs[run] = list(generated)
    finally:
        regen.regenerate_batch = batch
    dump(out, "regenerate", {"generated": runs})


def check_cli(out: Path, command: str, overrides_file: str) -> None:
    """``eaglekit COMMAND`` (generate, bench) in this process, through the CLI's own entry point, with
    tp_size=TP; what each rank printed goes to COMMAND-rank*.json. The CLI's load_target call is answered
    with the split target the other checks loaded (after checking that it asks for exactly that split),
    which saves the suite a second load of the model."""
    import contextlib
    import io

    import eaglekit.bench.methods
    import eaglekit.decode.cli
    import eaglekit.target
    from eaglekit.cli import main as cli

    overrides = json.loads(Path(overrides_file).read_text()) + [f"tp_size={TP}"]
    modules = [m for m in (eaglekit.target, eaglekit.decode.cli, eaglekit.bench.methods) if hasattr(m, "load_target")]
    kept = [m.load_target for m in modules]

    def loaded(name, **kw):
        assert (kw["tp_size"], kw["only_tp"], str(kw["dtype"]).removeprefix("torch.")) == (TP, True, "float32"), kw
        return split_target(str(name))

    printed, streams = io.StringIO(), (sys.stdout, sys.stderr)
    for m in modules:
        m.load_target = loaded
    try:
        with contextlib.redirect_stdout(printed):
            code = cli([command, *overrides])
    finally:  # the CLI silences its other ranks for the rest of the process
        sys.stdout, sys.stderr = streams
        for m, load in zip(modules, kept):
            m.load_target = load
    dump(out, command, {"code": code, "printed": printed.getvalue()})


def check_prepare(out: Path, overrides_file: str) -> None:
    from eaglekit.config import load_config
    from eaglekit.data_prep.prepare import PrepareConfig, run_prepare

    overrides = json.loads(Path(overrides_file).read_text()) + [f"target.tp_size={TP}"]
    dump(out, "prepare", run_prepare(load_config(PrepareConfig, None, overrides)))


def release_targets() -> None:
    """Drop the split targets the earlier checks shared (a check that loads its own target follows): the
    launch's processes then hold one split model each, not two, and the machine's memory is not reclaimed
    page by page while the next one loads (a float64 Qwen split after an fp32 one: ~9 -> ~6 GB per process)."""
    import gc

    _TARGETS.clear()
    gc.collect()


def check_train(out: Path, overrides_file: str) -> None:
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import train

    release_targets()  # training loads the target its config names
    overrides = json.loads(Path(overrides_file).read_text()) + [f"target.tp_size={TP}"]
    metrics = train(load_train_config(None, overrides))
    dump(out, "train", {"processes": metrics.get("processes"), "distributed_type": metrics.get("distributed_type")})


def resident_gb() -> float:
    """This process's resident memory now (VmRSS), in GB."""
    status = Path("/proc/self/status")
    if not status.exists():
        return float("nan")
    kb = next((int(x.split()[1]) for x in status.read_text().splitlines() if x.startswith("VmRSS:")), 0)
    return kb / 2**20


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
        elif check == "regenerate":
            check_regenerate(out, args.pop(0), args.pop(0))
        elif check in ("generate", "bench"):
            check_cli(out, check, args.pop(0))
        elif check == "prepare":
            check_prepare(out, args.pop(0))
        elif check == "train":
            check_train(out, args.pop(0))
        else:
            raise SystemExit(f"unknown check {check!r}")
        print(f"[tp_checks rank {rank()}] {check}: {time.perf_counter() - start:.1f} s, {resident_gb():.1f} GB resident",
              flush=True)
        if dist.is_initialized():  # a training run ends its process group (accelerate's end_training): last
            dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo's threads can hang it


if __name__ == "__main__":
    main()
