"""eaglekit's native head format: ``config.json`` (HeadConfig) + ``model.safetensors`` (head weights only).

The target's embedding / lm_head are borrowed, never saved. Loading checks the head against the target
it is bound to and refuses a mismatch with a message naming what differs. The helpers below that read
files (``read_config``, ``read_weights``, ``instantiate``...) are public: eaglekit.export reads its layouts
with them. Folders in an engine's layout are read by ``eaglekit.export.load_head``.

``DraftHead.save_pretrained(path)`` is ``save_head``: given to the class here, where saving lives.
"""
from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub
import torch
from safetensors.torch import load_file

from eaglekit.config import parse_dtype
from eaglekit.fileio import write_json, write_safetensors
from eaglekit.heads.base import DraftHead, check_draft_vocab
from eaglekit.heads.config import HeadConfig, check_target
from eaglekit.heads.registry import head_class

NATIVE_FORMAT = "eaglekit-head"
CONFIG, WEIGHTS = "config.json", "model.safetensors"

def save_head(head: DraftHead, path, extra: dict | None = None) -> Path:
    """Write ``config.json`` (HeadConfig fields + architectures) and ``model.safetensors``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": [type(head).__name__], "format": NATIVE_FORMAT,
           **head.config.to_dict(), "torch_dtype": str(head.dtype).removeprefix("torch."), **(extra or {})}
    write_safetensors(path / WEIGHTS, head.state_dict())
    write_json(path / CONFIG, cfg)
    return path


def _save_pretrained(self: DraftHead, path, **kw) -> Path:
    """``head.save_pretrained(path)``: the native folder, see ``heads.io.save_head``."""
    return save_head(self, path, **kw)


DraftHead.save_pretrained = _save_pretrained


def resolve_dir(path_or_id, token=None) -> Path:
    """A local folder, or a Hub repo id fetched with huggingface_hub (its cache, HF_ENDPOINT honoured)."""
    p = Path(str(path_or_id)).expanduser()
    if p.exists():
        return p
    if str(path_or_id).count("/") != 1:
        raise FileNotFoundError(f"head folder not found: {p}")
    return Path(huggingface_hub.snapshot_download(str(path_or_id), token=token))


def read_config(path: Path) -> dict:
    f = Path(path) / CONFIG
    if not f.is_file():
        raise FileNotFoundError(f"{f}: no config.json — not a head folder")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from e


def is_native(config: dict) -> bool:
    return config.get("format") == NATIVE_FORMAT


def target_name_of(head_dir) -> str:
    """The target a saved head (native or export folder) names, "" if none."""
    cfg = read_config(resolve_dir(head_dir))
    return (cfg.get("eaglekit") or cfg).get("target_name", "")


def native_config(data: dict, where: str) -> HeadConfig:
    data = {k: v for k, v in data.items() if k not in ("architectures", "format", "torch_dtype")}
    return HeadConfig.from_dict(data, where=where)


def load_native(path: Path, target, dtype=None, device=None) -> DraftHead:
    """Load a native head folder bound to ``target`` (checked against it)."""
    data = read_config(path)
    config = native_config(data, where=str(path / CONFIG))
    check_target(config, target, where=str(path))
    state = read_weights(path / WEIGHTS)
    return instantiate(config, state, target, dtype or saved_dtype(data, target), device, path / WEIGHTS)


def saved_dtype(data: dict, target) -> torch.dtype:
    """The dtype a config.json records (``torch_dtype`` or ``dtype``), else the target's."""
    name = data.get("torch_dtype") or data.get("dtype")
    try:
        return parse_dtype(name) if isinstance(name, str) else target.dtype
    except ValueError:  # another writer's value ("auto"): the dtype is then the target's, as when absent
        return target.dtype


def check_finite(tensors: dict, where) -> None:
    """Refuse NaN/Inf in any floating tensor, naming the first bad one (a corrupt or diverged head)."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{where}: tensor {name!r} holds {bad} non-finite value(s) (NaN/Inf) — "
                             "refusing a corrupt or diverged head")


def read_weights(f: Path) -> dict:
    """A head's safetensors file, every tensor checked finite."""
    if not f.is_file():
        raise FileNotFoundError(f"{f}: missing head weights")
    try:
        state = load_file(str(f))
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise ValueError(f"{f}: cannot read the head weights ({e})") from e
    check_finite(state, f)
    return state


def check_vocab_maps(state: dict, config: HeadConfig, where) -> None:
    """Refuse a file's draft-vocabulary maps an engine would misread (``check_draft_vocab``), naming the file."""
    if "d2t" not in state and "t2d" not in state:
        return
    if ("d2t" in state) != ("t2d" in state):
        raise ValueError(f"{where}: holds only one of d2t / t2d (the draft vocabulary needs both)")
    check_draft_vocab(state["d2t"], state["t2d"], config.draft_vocab_size, config.target_vocab_size, where)


def instantiate(config: HeadConfig, state: dict, target, dtype, device, where) -> DraftHead:
    """A head of ``config`` holding exactly ``state`` (names, shapes and vocabulary maps checked), bound to
    ``target``."""
    check_vocab_maps(state, config, where)
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
