"""Build, save and load heads: ``config.json`` + ``model.safetensors`` (head weights only).

The target's embedding / lm_head are borrowed, never saved. Loading checks the head against the target
it is bound to and refuses a mismatch with a message naming what differs.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from eaglekit.fileio import atomic_write, write_json, write_safetensors  # noqa: F401 (re-exported)
from eaglekit.heads.config import EAGLE1, EAGLE3, HeadConfig

NATIVE_FORMAT = "eaglekit-head"
ARCHITECTURES = {EAGLE1: "Eagle1Head", EAGLE3: "Eagle3Head"}
CONFIG, WEIGHTS = "config.json", "model.safetensors"


def head_class(kind: str):
    from eaglekit.heads.eagle1 import Eagle1Head
    from eaglekit.heads.eagle3 import Eagle3Head

    return {EAGLE1: Eagle1Head, EAGLE3: Eagle3Head}[kind]


def build_head(config: HeadConfig, target, dtype=None, device=None):
    """A fresh head for ``config``, on the target's device/dtype unless given, bound to ``target``."""
    head = head_class(config.kind)(config)
    head.to(device=device or target.device, dtype=dtype or target.dtype)
    return head.bind(target)


def check_target(config: HeadConfig, target, where: str = "head") -> None:
    """Raise ValueError naming every way ``target`` differs from the one the head was built for."""
    diffs = []
    if config.hidden_size != target.hidden_size:
        diffs.append(f"hidden size: head {config.hidden_size} vs target {target.hidden_size}")
    if config.target_vocab_size != target.vocab_size:
        diffs.append(f"vocab size: head {config.target_vocab_size} vs target {target.vocab_size}")
    if config.target_num_layers != target.num_layers:
        diffs.append(f"layer count: head {config.target_num_layers} vs target {target.num_layers}")
    if config.target_fingerprint and config.target_fingerprint != target.fingerprint():
        diffs.append(f"fingerprint (config + tokenizer): head {config.target_fingerprint} "
                     f"(trained for {config.target_name or '?'}) vs target {target.fingerprint()} "
                     f"({getattr(target, 'name', '?')})")
    if diffs:
        raise ValueError(f"{where}: this head was not trained for this target — " + "; ".join(diffs))


def save_head(head, path, extra: dict | None = None) -> Path:
    """Write ``config.json`` (HeadConfig fields + architectures) and ``model.safetensors``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": [ARCHITECTURES[head.config.kind]], "format": NATIVE_FORMAT,
           **head.config.to_dict(), "torch_dtype": str(head.dtype).removeprefix("torch."), **(extra or {})}
    write_safetensors(path / WEIGHTS, head.state_dict())
    write_json(path / CONFIG, cfg)
    return path


def resolve_dir(path_or_id, token=None) -> Path:
    """A local folder, or a Hub repo id fetched with huggingface_hub (its cache, HF_ENDPOINT honoured)."""
    p = Path(str(path_or_id)).expanduser()
    if p.exists():
        return p
    if str(path_or_id).count("/") != 1:
        raise FileNotFoundError(f"head folder not found: {p}")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path_or_id), token=token))


def read_config(path: Path) -> dict:
    f = Path(path) / CONFIG
    if not f.is_file():
        raise FileNotFoundError(f"{f}: no config.json — not a head folder")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from e


def native_config(data: dict, where: str) -> HeadConfig:
    data = {k: v for k, v in data.items() if k not in ("architectures", "format", "torch_dtype")}
    return HeadConfig.from_dict(data, where=where)


def load_head(path_or_id, target, dtype=None, device=None, token=None):
    """Load a saved head (native folder, Hub id, or an ``eaglekit export`` folder) bound to ``target``."""
    path = resolve_dir(path_or_id, token=token)
    data = read_config(path)
    if data.get("format") != NATIVE_FORMAT:
        from eaglekit.heads.export import load_export

        return load_export(path, target, dtype=dtype, device=device)
    config = native_config(data, where=str(path / CONFIG))
    check_target(config, target, where=str(path))
    state = _read_weights(path / WEIGHTS)
    return _instantiate(config, state, target, dtype or _saved_dtype(data, target), device, path / WEIGHTS)


def _saved_dtype(data: dict, target):
    name = data.get("torch_dtype") or data.get("dtype")
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else target.dtype


def check_finite(tensors: dict, where) -> None:
    """Refuse NaN/Inf in any floating tensor, naming the first bad one (a corrupt or diverged head)."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{where}: tensor {name!r} holds {bad} non-finite value(s) (NaN/Inf) — "
                             "refusing a corrupt or diverged head")


def _read_weights(f: Path) -> dict:
    if not f.is_file():
        raise FileNotFoundError(f"{f}: missing head weights")
    try:
        state = load_file(str(f))
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise ValueError(f"{f}: cannot read the head weights ({e})") from e
    check_finite(state, f)
    return state


def _instantiate(config: HeadConfig, state: dict, target, dtype, device, where):
    head = head_class(config.kind)(config)
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k} {list(state[k].shape)} (expected {list(v.shape)})" for k, v in expected.items()
             if k in state and state[k].shape != v.shape]
    if missing or unexpected or wrong:
        raise ValueError(f"{where}: weights do not fit a {config.kind} head — missing {missing}, "
                         f"unexpected {unexpected}, wrong shape {wrong}")
    head.load_state_dict(state, strict=True)
    head.to(device=device or target.device, dtype=dtype)
    return head.bind(target)
