"""``eaglekit prepare``: conversations → tokens → (regeneration) → draft vocab → feature shards.

    eaglekit prepare --config configs/prepare-smollm2.yaml output_dir=prepared/x num_conversations=500
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \\
        -m eaglekit.cli prepare --config configs/prepare-smollm2.yaml       # N processes split the shards
    torchrun --nproc_per_node 2 -m eaglekit.cli prepare --config ...           # the same with torchrun

Everything lands in ``output_dir`` (the ``features_dir`` a train config points at): ``manifest.json``,
``shard-*.safetensors``, ``draft_vocab.safetensors`` and, with regeneration, ``regenerated.jsonl``.
Every step resumes: regeneration continues its jsonl, capture skips finished shards. Under a launcher
every process reads and tokenizes the same data (cheap, deterministic), regenerates its share of the
batches (merged into one ``regenerated.jsonl`` when all are done) and writes its own shards. With
``target.tp_size`` > 1 each TP group acts as one such process: its processes regenerate and capture together
on the split target, and the group's first process writes the files.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from eaglekit.config import NonNegInt, PosFloat, PosInt, TargetSpec, load_config
from eaglekit.data_prep.capture import (
    MANIFEST,
    build_manifest,
    capture_features,
    check_resume,
    check_same_setup,
    data_ranks,
    dist_info,
    feature_bytes_per_token,
    resolve_taps,
)
from eaglekit.data_prep.conversations import Conversations, load_sharegpt, read_conversations
from eaglekit.data_prep.engine import VllmEngine, check_engine_target, engine_features, engine_layer_ids
from eaglekit.data_prep.regenerate import RegenerateConfig, regenerate
from eaglekit.data_prep.template import tokenize_conversations
from eaglekit.data_prep.vocab import build_draft_vocab, save_draft_vocab, vocab_record
from eaglekit.heads import EAGLE3, KINDS
from eaglekit.target import load_target_from, resolve

log = logging.getLogger(__name__)
REGENERATED = "regenerated.jsonl"


@dataclass
class PrepareConfig:
    target: TargetSpec = field(default_factory=TargetSpec)  # device: cpu unless given ("cuda": cuda:LOCAL_RANK)
    data: str = "sharegpt"  # the embedded ShareGPT, or a .json/.jsonl file, folder or saved dataset
    split: str | None = None  # for a saved DatasetDict
    num_conversations: NonNegInt = 0  # 0 = all
    max_turns: NonNegInt = 0  # keep each conversation's first N user turns (0 = all); regeneration cost scales with it
    strict: bool = False  # stop at the first malformed conversation instead of skipping and counting
    max_length: PosInt = 2048  # tokens per sample (truncated)
    output_dir: str = "prepared/smollm2"
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    draft_vocab_size: PosInt = 32000  # clipped to the target vocab
    capture: bool = True  # False: stop after the vocab (online training needs no shards)
    kind: str = EAGLE3  # the head the features are for: eagle3 (its taps + last) or eagle1 (last only)
    layer_ids: list[NonNegInt] | None = None  # EAGLE-3 taps; default (2, N//2, N-3)
    shard_mb: PosFloat = 1024  # feature bytes per shard, MiB
    feature_dtype: Literal["bfloat16", "float8_e4m3fn"] = "bfloat16"  # fp8: half the disk (scaled per token)
    batch_tokens: PosInt = 8192  # padded tokens per capture forward
    capture_engine: Literal["hooks", "vllm"] = "hooks"  # vllm: the features from vLLM's extract_hidden_states
    engine_endpoint: str = ""  # http://HOST:PORT of a server started with engine.server_args ("": eaglekit starts
    # one from its pinned vLLM CPU environment); its storage folder must be engine_storage, visible here
    engine_storage: str = ""  # where the server writes each request's hidden states ("": output_dir/engine-states)
    engine_concurrency: PosInt = 1  # requests in flight at once
    engine_threads: NonNegInt = 0  # the started server's CPU threads (0: all cores)
    progress: bool = True


def first_turns(messages: list[dict], n: int) -> list[dict]:
    """The messages up to and including the answer to the ``n``-th user turn (``n=0``: all)."""
    if n <= 0:
        return messages
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return messages if len(users) <= n else messages[: users[n]]


def load_conversations(cfg: PrepareConfig) -> Conversations:
    convs = _read(cfg)
    if cfg.max_turns:
        convs[:] = [{**c, "messages": first_turns(c["messages"], cfg.max_turns)} for c in convs]
    return convs


def _read(cfg: PrepareConfig) -> Conversations:
    limit = cfg.num_conversations or None
    if cfg.data == "sharegpt":
        return load_sharegpt(strict=cfg.strict, limit=limit)
    return read_conversations(cfg.data, strict=cfg.strict, split=cfg.split, limit=limit)


def disk_report(out: Path, tokens: int, bytes_per_token: int, feature_dtype: str = "bfloat16") -> str:
    need = tokens * (bytes_per_token + 5)  # + int32 id + uint8 mask per token
    free = shutil.disk_usage(out if out.exists() else out.parent if out.parent.exists() else Path(".")).free
    msg = (
        f"capture needs {_size(need)} for {tokens:,} tokens ({bytes_per_token} B/token of {feature_dtype} "
        f"features + 5 B of ids/mask); {_size(free)} free at {out}"
    )
    return msg + ("  ** NOT ENOUGH SPACE **" if need > free else "")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def run_prepare(cfg: PrepareConfig) -> dict:
    if cfg.kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {cfg.kind!r}")
    first = dist_info()[0] == 0  # the first of all processes (a TP group's processes share a data rank)
    say = print if first else (lambda *a, **k: None)
    out = Path(cfg.output_dir)
    # the decoder's weights load only to run here (a hook capture, in-process regeneration); an engine capture, a
    # regeneration through a server and no capture read the tokenizer, config and final norm (1.5B: ~2 min, 5 GB)
    target = load_target_from(cfg.target, decoder=(cfg.capture and cfg.capture_engine == "hooks") or
                              (cfg.regenerate.enabled and not cfg.regenerate.endpoint))
    rank, world = data_ranks(target)  # TP groups, when the target is split; else the processes
    # every check comes before the first write (regenerated.jsonl, the vocabulary, the shards)
    taps = resolve_taps(target, cfg.kind, cfg.layer_ids)
    if cfg.capture and cfg.capture_engine == "vllm":
        check_engine_target(target.model_config, taps, target.num_layers)
    bpt = feature_bytes_per_token(target.hidden_size, len(taps), cfg.feature_dtype)
    shard_tokens = max(1, int(cfg.shard_mb * 2**20 // bpt))
    _check_output_dir(out, cfg, target, taps, shard_tokens)
    convs = load_conversations(cfg)
    say(
        f"{len(convs):,} conversations from {cfg.data} ({len(convs.skipped)} malformed skipped"
        + (f", first: {convs.skipped[0]})" if convs.skipped else ")")
    )
    if cfg.regenerate.enabled:
        out.mkdir(parents=True, exist_ok=True)
        path = regenerate(
            target,
            convs,
            out / REGENERATED,
            cfg.regenerate,
            progress=cfg.progress and first,  # one bar
            rank=rank,
            world_size=world,
        )
        convs = read_conversations(path, strict=False)
        say(f"regenerated answers in {path} ({convs.unanswered} conversation(s) without an answer: "
            "a prompt over regenerate.max_prompt_tokens or an empty answer, each line's regenerate_error)")
    samples, empty = tokenize_conversations(
        target.tokenizer, convs, cfg.max_length, progress=cfg.progress and first
    )
    tokens = sum(len(s["input_ids"]) for s in samples)
    say(
        f"{len(samples):,} samples, {tokens:,} tokens ({len(empty)} dropped: no assistant token "
        f"within max_length={cfg.max_length})"
    )
    if not samples:
        raise SystemExit("no samples left to prepare")
    size = min(cfg.draft_vocab_size, target.vocab_size)
    d2t, t2d = build_draft_vocab(samples, size, target.vocab_size)
    vocab = vocab_record(d2t, t2d)
    extra = {"data": cfg.data, "max_length": cfg.max_length, "regenerated": cfg.regenerate.enabled,
             "capture_engine": cfg.capture_engine}
    if cfg.capture:  # the whole plan (these samples) against a capture already there, before the vocab write
        check_resume(out / MANIFEST, build_manifest(target, samples, cfg.kind, taps, shard_tokens, extra, vocab,
                                                    cfg.feature_dtype))
    if dist_info()[0] == 0:  # one writer of the vocabulary, whatever the layout
        say(f"draft vocabulary ({size} tokens) → {save_draft_vocab(out, d2t, t2d)}")
    result = {"samples": len(samples), "tokens": tokens, "skipped": len(convs.skipped), "empty": len(empty)}
    if not cfg.capture:
        return result
    say(disk_report(out, tokens, bpt, cfg.feature_dtype))
    with _engine(cfg, target, taps, samples, rank) as features:
        manifest = _capture(cfg, target, samples, out, taps, shard_tokens, extra, vocab, features)
    mine = sum(1 for j in range(len(manifest["shards"])) if j % world == rank)
    if target.layout.writes:
        print(
            f"[rank {rank}/{world}] wrote {mine} of {len(manifest['shards'])} shard(s) to {out}"
            + (" — capture complete" if manifest["complete"] else " — the other processes write the rest")
        )
    return {**result, "complete": manifest["complete"], "shards": len(manifest["shards"])}


def _capture(cfg: PrepareConfig, target, samples, out: Path, taps, shard_tokens: int, extra, vocab, features):
    return capture_features(
        target,
        samples,
        out,
        cfg.kind,
        taps,
        shard_tokens=shard_tokens,
        batch_tokens=cfg.batch_tokens,
        progress=cfg.progress,
        extra=extra,
        draft_vocab=vocab,
        feature_dtype=cfg.feature_dtype,
        features=features,
    )


@contextlib.contextmanager
def _engine(cfg: PrepareConfig, target, taps, samples, rank: int):
    """None for the hook capture; for capture_engine=vllm the features function of an engine started at the
    first shard this process writes (none for a resumed capture with nothing left), one server per process:
    each process's files land in a storage folder of its own."""
    if cfg.capture_engine == "hooks":
        yield None
        return
    storage = Path(cfg.engine_storage or Path(cfg.output_dir) / "engine-states") / f"rank-{rank}"
    longest = max(len(s["input_ids"]) for s in samples)
    started = []
    with contextlib.ExitStack() as stack:
        def features(part):
            if not started:
                engine = VllmEngine(resolve(target.name)[0], engine_layer_ids(taps, target.num_layers), storage,
                                    max_model_len=longest + 1, endpoint=cfg.engine_endpoint,
                                    threads=cfg.engine_threads or None, concurrency=cfg.engine_concurrency)
                started.append(engine_features(stack.enter_context(engine), target, taps))
            return started[0](part)

        yield features


def _check_output_dir(out: Path, cfg: PrepareConfig, target, taps, shard_tokens: int) -> None:
    """Refuse, before anything is written, an output_dir holding a capture this run cannot resume."""
    if not (out / MANIFEST).exists():
        return
    if not cfg.capture:
        raise ValueError(
            f"{out} holds a capture ({MANIFEST}); capture=false would replace its draft vocabulary: "
            "use another output_dir"
        )
    check_same_setup(out / MANIFEST, target, cfg.kind, taps, shard_tokens)


def add_arguments(parser) -> None:
    parser.epilog = "config keys: " + ", ".join(PrepareConfig.__dataclass_fields__)


def run(args) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = load_config(PrepareConfig, args.config, args.overrides)
    run_prepare(cfg)
    return 0
