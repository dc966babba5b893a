"""Offline capture: target forward over tokenized samples → feature shards + manifest.json.

Layout (docs/formats.md, "Feature shards")::

    features/manifest.json
    features/shard-00000.safetensors   input_ids [T] int32, loss_mask [T] uint8, offsets [N+1] int64,
                                       taps [T, L*H] bf16 (EAGLE-3; not in eagle1), last [T, H] bf16

(``taps`` is the name of the fused taps tensor everywhere: ``TargetOutput.taps``, items, batches. Shards
written before format version 3 call it ``hidden``; ``FeatureDataset`` reads both.)

The samples are cut into shards by a *plan* that depends only on the data and ``shard_tokens`` (whole
samples, in order, until a shard holds ``shard_tokens`` tokens). Shard j is written by process
``j % world_size``, so 1 or N processes (``accelerate launch`` / ``torchrun``, read from RANK/WORLD_SIZE)
produce the same files. With a target split over TP groups (``target.tp_size``) the groups take the place
of the processes: a group's processes run each forward together and its first process writes. Each shard is written to a temporary name and renamed when complete; a rerun
skips shards that exist (resuming at the first missing one) after checking that the plan in the existing
manifest is the same (same data, target, taps), and refuses to mix runs otherwise. Whoever finishes the
last shard marks the manifest complete; readers refuse an incomplete capture.

Checksums: the sha256 of each shard's bytes is computed by its writer right after writing (before the
rename) and kept in ``checksums/<shard>.sha256``, since several processes cannot safely share one manifest
while they write; the process that completes the capture copies every shard's sum into the manifest
(``shards[j]["sha256"]``). ``FeatureDataset`` checks a shard against it when it first opens it.

Bytes per token on disk = (L·H + H)·2 for the bf16 features, plus 5 for ``input_ids``/``loss_mask``.
``feature_dtype="float8_e4m3fn"`` halves that: each token's taps (each tap alone) and ``last`` are scaled
so their largest magnitude is e4m3's 448 and stored in fp8, the scales beside them in fp32 (``taps_scale``
[T, L], ``last_scale`` [T, 1]); (L + 1)·(H + 4) bytes per token. Readers give bf16 back (``dequantize``).
``convert_features`` rewrites a bf16 capture in fp8 without the target: the bytes a fp8 capture writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from eaglekit import __version__
from eaglekit.data_prep.template import template_hash
from eaglekit.fileio import atomic_write, write_json, write_text
from eaglekit.heads import EAGLE3, tap_layers
from eaglekit.target import tensor_parallel as tp

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
SUMS_DIR = "checksums"  # per-shard sha256 files, gathered into the manifest when the capture completes
# 2: shards[j]["sha256"] and "draft_vocab" (version 1 manifests have neither); 3: the taps tensor is "taps"
FORMAT_VERSION = 3
FEATURE_DTYPE = torch.bfloat16
FP8 = "float8_e4m3fn"
FEATURE_DTYPES = ("bfloat16", FP8)  # how shards store the features
FP8_MAX = 448.0  # e4m3's largest finite value


def shard_name(j: int) -> str:
    return f"shard-{j:05d}.safetensors"


def feature_bytes_per_token(hidden_size: int, num_taps: int, feature_dtype: str = "bfloat16") -> int:
    """Bytes of ``taps`` + ``last`` per token: (L·H + H)·2 in bf16, (L + 1)·(H + 4) in fp8 with its fp32
    scales (L = 0 for eagle1)."""
    if feature_dtype == FP8:
        return (num_taps + 1) * (hidden_size + 4)
    return (num_taps * hidden_size + hidden_size) * 2


def quantize(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, G·H] as e4m3 with one fp32 scale per token and group (a tap), [T, G]: each group's largest
    magnitude maps to 448, so no value overflows and small tokens keep their resolution."""
    t = x.float().view(x.shape[0], groups, -1)
    scale = (t.abs().amax(dim=-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (t / scale[..., None]).to(torch.float8_e4m3fn).view(x.shape), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype=FEATURE_DTYPE) -> torch.Tensor:
    """The inverse of ``quantize``: [T, G·H] in ``dtype``."""
    return (q.float().view(q.shape[0], scale.shape[1], -1) * scale[..., None].float()).view(q.shape).to(dtype)


def stored_features(t: dict, feature_dtype: str, num_taps: int) -> dict:
    """A shard's tensors as stored: bf16 as they are; fp8 quantized, each with its ``<key>_scale``."""
    if feature_dtype != FP8:
        return t
    out = dict(t)
    for key, groups in (("taps", num_taps), ("last", 1)):
        if key in t:
            out[key], out[f"{key}_scale"] = quantize(t[key], groups)
    return out


def fp8_plan_hash(bf16_plan_hash: str, feature_dtype: str) -> str:
    """A capture's identity in another storage dtype (the bf16 one unchanged, so old captures resume)."""
    if feature_dtype == "bfloat16":
        return bf16_plan_hash
    return hashlib.sha256(f"{bf16_plan_hash}:{feature_dtype}".encode()).hexdigest()[:16]


def resolve_taps(target, kind: str, layer_ids) -> tuple[int, ...]:
    """The layers whose inputs a head of ``kind`` reads (its class says: heads.tap_layers)."""
    return tap_layers(kind, target, layer_ids)


def dist_info() -> tuple[int, int]:
    """(rank, world_size) from the launcher's environment (accelerate launch / torchrun); (0, 1) alone."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def data_ranks(target) -> tuple[int, int]:
    """(rank, world_size) over which the shards are split: the launch's processes, or its TP groups when the
    target is split (the processes of a group capture the same shards together; its first one writes)."""
    layout = tp.layout_of(target)
    return (layout.dp_rank, layout.dp_size) if layout.tp_size > 1 else dist_info()


def plan_shards(lengths: list[int], shard_tokens: int) -> list[tuple[int, int]]:
    """Consecutive ``(first, stop)`` sample ranges holding ~``shard_tokens`` tokens each (≥ 1 sample)."""
    plan, first, acc = [], 0, 0
    for i, n in enumerate(lengths):
        acc += n
        if acc >= shard_tokens:
            plan.append((first, i + 1))
            first, acc = i + 1, 0
    if first < len(lengths):
        plan.append((first, len(lengths)))
    return plan


@torch.no_grad()
def compute_features(
    target,
    samples: list[dict],
    kind: str = EAGLE3,
    layer_ids=None,
    batch_tokens: int = 8192,
    dtype=FEATURE_DTYPE,
) -> list[dict]:
    """Item dicts (``input_ids``, ``loss_mask``, ``taps`` (eagle3), ``last``) for ``samples``, in order.

    Samples are batched by length (right-padded, ≤ ``batch_tokens`` padded tokens per forward); padding
    sits after each sample's tokens, so a causal model's features for them are unaffected.
    """
    taps = resolve_taps(target, kind, layer_ids)
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]["input_ids"]))
    out: list[dict | None] = [None] * len(samples)
    pos = 0
    while pos < len(order):
        stop = pos + 1
        while stop < len(order) and len(samples[order[stop]]["input_ids"]) * (stop + 1 - pos) <= batch_tokens:
            stop += 1
        batch = [samples[i] for i in order[pos:stop]]
        for i, item in zip(order[pos:stop], _forward_batch(target, batch, taps, dtype)):
            out[i] = item
        pos = stop
    return out


def _forward_batch(target, batch, taps, dtype):
    width = max(len(s["input_ids"]) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    att = torch.zeros(len(batch), width, dtype=torch.long)
    for b, s in enumerate(batch):
        n = len(s["input_ids"])
        ids[b, :n] = torch.as_tensor(s["input_ids"])
        att[b, :n] = 1
    out = target.features(ids.to(target.device), att.to(target.device), layer_ids=taps)
    # cast on the device, then one copy to host: half the bytes over PCIe for a GPU target
    tapped = out.taps.to(dtype).cpu() if taps else None
    last = out.last.to(dtype).cpu()
    items = []
    for b, s in enumerate(batch):
        n = len(s["input_ids"])
        item = {
            "input_ids": torch.as_tensor(s["input_ids"]).long(),
            "loss_mask": torch.as_tensor(s["loss_mask"]).long(),
        }
        if tapped is not None:
            item["taps"] = tapped[b, :n].clone()  # own storage: no padded batch kept alive
        item["last"] = last[b, :n].clone()
        items.append(item)
    return items


def shard_tensors(items: list[dict]) -> dict[str, torch.Tensor]:
    """Concatenate item dicts into one shard's tensors (the on-disk dtypes)."""
    lengths = torch.tensor([0] + [len(it["input_ids"]) for it in items], dtype=torch.long)
    t = {
        "input_ids": torch.cat([it["input_ids"] for it in items]).to(torch.int32),
        "loss_mask": torch.cat([it["loss_mask"] for it in items]).to(torch.uint8),
        "offsets": torch.cumsum(lengths, 0),
    }
    if "taps" in items[0]:
        t["taps"] = torch.cat([it["taps"] for it in items]).contiguous()
    t["last"] = torch.cat([it["last"] for it in items]).contiguous()
    return t


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, streamed (fast next to the capture that wrote it)."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def plan_hash(samples: list[dict], meta: dict) -> str:
    """Identity of a capture: tokens, masks, and what produced the features (target, taps, sharding)."""
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for s in samples:
        h.update(torch.as_tensor(s["input_ids"]).to(torch.int32).numpy().tobytes())
        h.update(torch.as_tensor(s["loss_mask"]).to(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def build_manifest(
    target, samples, kind, taps, shard_tokens, extra: dict | None = None, draft_vocab: dict | None = None,
    feature_dtype: str = "bfloat16",
) -> dict:
    """The capture's manifest; ``draft_vocab`` is the record of the vocabulary prepared with it
    (``{"file", "sha256", "size"}``, see ``vocab.vocab_record``), which the trainer checks."""
    lengths = [len(s["input_ids"]) for s in samples]
    plan = plan_shards(lengths, shard_tokens)
    tgt = {
        "name": target.name,
        "fingerprint": target.fingerprint(),
        "hidden_size": target.hidden_size,
        "num_layers": target.num_layers,
        "vocab_size": target.vocab_size,
        "model_type": getattr(target.config, "model_type", None),
        "revision": getattr(target.config, "_commit_hash", None),
    }
    ident = {
        "target": tgt["fingerprint"],
        "kind": kind,
        "layer_ids": list(taps),
        "shard_tokens": shard_tokens,
    }
    manifest = {
        "format": "eaglekit-features",
        "format_version": FORMAT_VERSION,
        "eaglekit_version": __version__,
        "target": tgt,
        "kind": kind,
        "layer_ids": list(taps),
        "hidden_size": target.hidden_size,
        "dtype": feature_dtype,
        "chat_template_hash": template_hash(target.tokenizer),
        "bytes_per_token": feature_bytes_per_token(target.hidden_size, len(taps), feature_dtype),
        "num_samples": len(samples),
        "num_tokens": sum(lengths),
        "shard_tokens": shard_tokens,
        "plan_hash": fp8_plan_hash(plan_hash(samples, ident), feature_dtype),
        "shards": [
            {"file": shard_name(j), "first_sample": a, "num_samples": b - a, "num_tokens": sum(lengths[a:b])}
            for j, (a, b) in enumerate(plan)
        ],
        "lengths": lengths,
        "sample_ids": [str(s.get("id", i)) for i, s in enumerate(samples)],
        "extra": extra or {},
        "complete": False,
    }
    if draft_vocab is not None:
        manifest["draft_vocab"] = draft_vocab
    return manifest


def capture_features(
    target,
    samples: list[dict],
    out_dir: str | Path,
    kind: str = EAGLE3,
    layer_ids=None,
    shard_tokens: int = 200_000,
    batch_tokens: int = 8192,
    rank: int | None = None,
    world_size: int | None = None,
    progress: bool = True,
    extra: dict | None = None,
    on_shard=None,
    draft_vocab: dict | None = None,
    feature_dtype: str = "bfloat16",
    features=None,
) -> dict:
    """Write this process's shards of ``samples`` under ``out_dir``; returns the manifest.

    Resumable and multi-process safe (see the module docstring). ``on_shard(j)`` is called after each
    shard is written (progress hooks, tests). ``draft_vocab``: see ``build_manifest``. ``features``: a
    function of a shard's samples giving their item dicts in place of the target's forward
    (``engine.engine_features``: a serving engine's hidden states). A target split over
    a TP group (``target.layout``): the group's processes run every forward together and its first process
    alone writes, so the files are those of a run with one process per group.
    """
    layout = tp.layout_of(target)
    env_rank, env_world = data_ranks(target)
    rank = env_rank if rank is None else rank
    world_size = env_world if world_size is None else world_size
    out = Path(out_dir)
    taps = resolve_taps(target, kind, layer_ids)
    if feature_dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature_dtype must be one of {', '.join(FEATURE_DTYPES)}, got {feature_dtype!r}")
    manifest = build_manifest(target, samples, kind, taps, shard_tokens, extra, draft_vocab, feature_dtype)
    check_resume(out / MANIFEST, manifest)
    if layout.writes:
        out.mkdir(parents=True, exist_ok=True)
        if not (out / MANIFEST).exists():
            write_json(out / MANIFEST, manifest, indent=1)
    mine = [j for j in range(len(manifest["shards"])) if j % world_size == rank]
    # the group's writer says which shards are left: every process of a group must run the same forwards
    todo = tp.same_in_group(layout, [j for j in mine if not (out / shard_name(j)).exists()])
    if layout.writes:
        _remove_stale_temps(out, todo)
    total = sum(manifest["shards"][j]["num_tokens"] for j in mine)
    done = total - sum(manifest["shards"][j]["num_tokens"] for j in todo)
    bar = tqdm(
        total=total, initial=done, unit="tok", desc=f"capture[{rank}/{world_size}]", disable=not progress
    )
    for j in todo:
        sh = manifest["shards"][j]
        part = samples[sh["first_sample"] : sh["first_sample"] + sh["num_samples"]]
        items = features(part) if features is not None else compute_features(target, part, kind, taps, batch_tokens)
        if layout.writes:
            _write_shard(out / shard_name(j), stored_features(shard_tensors(items), feature_dtype, len(taps)), manifest)
        bar.update(sh["num_tokens"])
        if on_shard is not None:
            on_shard(j)
    bar.close()
    return finalize(out, manifest) if layout.writes else manifest


# a killed writer's leftovers: "shard-00001.safetensors.tmp-<pid>" (before fileio) or fileio's
# ".shard-00001.safetensors.<random>.tmp"
_STALE = re.compile(r"^\.?shard-(\d+)\.safetensors\.(tmp-.*|.*\.tmp)$")


def _remove_stale_temps(out: Path, todo: list[int]) -> None:
    for path in out.iterdir():
        m = _STALE.match(path.name)
        if m and int(m.group(1)) in todo:
            path.unlink(missing_ok=True)


def _write_shard(path: Path, tensors: dict, manifest: dict) -> None:
    """Write the shard atomically; its sha256 is computed from the written bytes and saved (in
    ``checksums/``) before the rename, so every shard that exists under its final name has a sum."""
    # one metadata key: safetensors writes a multi-key map in hash order, which would break byte equality
    meta = json.dumps({"plan_hash": manifest["plan_hash"], "kind": manifest["kind"]}, sort_keys=True)

    def write(tmp: str) -> None:
        save_file(tensors, tmp, metadata={"eaglekit": meta})
        make_readable(Path(tmp))
        write_text(sum_path(path), file_sha256(tmp) + "\n")

    atomic_write(path, write)


def sum_path(shard: Path) -> Path:
    return shard.parent / SUMS_DIR / f"{shard.name}.sha256"


def make_readable(path: Path) -> None:
    """safetensors creates files 0600; give them the usual umask-based mode so others can read the data."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def check_resume(path: Path, manifest: dict) -> None:
    """Refuse to write into a directory whose manifest plans another capture (writes nothing)."""
    if not path.exists():
        return
    old = json.loads(path.read_text())
    if old.get("plan_hash") != manifest["plan_hash"]:
        raise ValueError(
            f"{path.parent} holds a different capture (plan {old.get('plan_hash')} vs "
            f"{manifest['plan_hash']}: other data, target, taps or shard_tokens); "
            "use a new output directory or delete it"
        )


def check_same_setup(path: Path, target, kind: str, taps, shard_tokens: int) -> None:
    """Before the data is read: refuse a directory whose manifest was captured with another target,
    kind, taps or shard size (what the plan hash covers besides the samples), naming what differs."""
    if not path.exists():
        return
    old = json.loads(path.read_text())
    ours = {"target": target.fingerprint(), "kind": kind, "layer_ids": list(taps), "shard_tokens": shard_tokens}
    theirs = {**{k: old.get(k) for k in ours}, "target": old.get("target", {}).get("fingerprint")}
    diffs = [f"{k} {theirs[k]} vs {ours[k]}" for k in ours if theirs[k] != ours[k]]
    if diffs:
        raise ValueError(
            f"{path.parent} holds a different capture ({'; '.join(diffs)}); "
            "use a new output directory or delete it"
        )


def finalize(out: Path, manifest: dict) -> dict:
    """Mark the manifest complete, with every shard's sha256, once every planned shard exists
    (idempotent; any process may call)."""
    missing = [s["file"] for s in manifest["shards"] if not (out / s["file"]).exists()]
    if not missing:
        shards = [{**s, "sha256": _shard_sum(out / s["file"])} for s in manifest["shards"]]
        manifest = {**manifest, "shards": shards, "complete": True}
        write_json(out / MANIFEST, manifest, indent=1)
    return manifest


def _shard_sum(shard: Path) -> str:
    try:
        return sum_path(shard).read_text().strip()
    except FileNotFoundError:  # written by an eaglekit without checksums, resumed by this one
        log.warning("%s has no recorded checksum (older capture): computing it now", shard)
        return file_sha256(shard)


def convert_features(src: str | Path, dst: str | Path, feature_dtype: str = FP8) -> dict:
    """Rewrite the complete bf16 capture ``src`` into ``dst`` stored as ``feature_dtype``, shard by shard
    (the bytes a capture with that dtype writes; no target needed); the draft vocabulary is copied."""
    src, dst = Path(src), Path(dst)
    old = json.loads((src / MANIFEST).read_text())
    if not old.get("complete") or old.get("dtype", "bfloat16") != "bfloat16":
        raise ValueError(f"{src}: convert_features reads a complete bf16 capture (manifest dtype "
                         f"{old.get('dtype')!r}, complete {old.get('complete')})")
    if (dst / MANIFEST).exists():
        raise ValueError(f"{dst} holds a capture already: use a new directory")
    dst.mkdir(parents=True, exist_ok=True)
    taps = len(old["layer_ids"])
    manifest = {**old, "dtype": feature_dtype, "plan_hash": fp8_plan_hash(old["plan_hash"], feature_dtype),
                "bytes_per_token": feature_bytes_per_token(old["hidden_size"], taps, feature_dtype),
                "complete": False, "shards": [{k: v for k, v in s.items() if k != "sha256"} for s in old["shards"]]}
    for s in manifest["shards"]:
        t = load_file(str(src / s["file"]))
        if "hidden" in t:  # capture format < 3
            t["taps"] = t.pop("hidden")
        _write_shard(dst / s["file"], stored_features(t, feature_dtype, taps), manifest)
    for extra in src.glob("draft_vocab*.safetensors"):
        shutil.copy2(extra, dst / extra.name)
    return finalize(dst, manifest)
