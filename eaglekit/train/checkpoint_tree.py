"""A checkpoint's nested state (optimizer / scheduler / RNG state dicts) as one safetensors file plus one
JSON file — no pickle anywhere, so loading a checkpoint can never run code.

Tensors go to ``NAME.safetensors`` and everything else to ``NAME.json``, where the tree keeps its shape
with a few tagged nodes: ``{"$tensor": key}``, ``{"$tuple": [...]}``, ``{"$items": [[k, v], ...]}`` (a
mapping whose keys are not all strings, e.g. an optimizer's per-parameter state), ``{"$float": "nan"}``
and ``{"$ndarray": {...}}``. Objects that are neither (DeepSpeed's loss scaler, its enum of the ZeRO
stage) are written as ``{"$skipped": type}`` when allowed, and take the running process's current value
on load (``like``): they describe the setup, which the run rebuilds from its config anyway.
"""
from __future__ import annotations

import enum
import json
import math
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from eaglekit.fileio import write_safetensors, write_text

TAGS = ("$tensor", "$tuple", "$items", "$float", "$ndarray", "$skipped")


def save_tree(path_stem: str | Path, tree, skip_unknown: bool = False) -> list[Path]:
    """Write ``tree`` as ``<stem>.safetensors`` + ``<stem>.json`` (atomically); returns both paths."""
    stem = Path(path_stem)
    tensors: dict[str, torch.Tensor] = {}
    doc = _encode(tree, "", tensors, skip_unknown)
    st, js = stem.with_name(stem.name + ".safetensors"), stem.with_name(stem.name + ".json")
    write_safetensors(st, tensors)
    write_text(js, json.dumps(doc, allow_nan=False) + "\n")
    return [st, js]


def load_tree(path_stem: str | Path, like=None):
    """Read what ``save_tree`` wrote; ``$skipped`` nodes take their value from ``like`` (same shape)."""
    stem = Path(path_stem)
    doc = json.loads(stem.with_name(stem.name + ".json").read_text())
    tensors = load_file(str(stem.with_name(stem.name + ".safetensors")))
    return _decode(doc, tensors, like, stem.name)


def to_json(tree) -> str:
    """A tensor-free tree (loop counters, scheduler state) as tagged JSON text."""
    tensors: dict = {}
    doc = _encode(tree, "", tensors, False)
    if tensors:
        raise TypeError(f"to_json: tensors at {sorted(tensors)}; use save_tree")
    return json.dumps(doc, indent=1, allow_nan=False) + "\n"


def from_json(text: str, where: str = "json"):
    return _decode(json.loads(text), {}, None, where)


def _encode(node, path: str, tensors: dict, skip: bool):
    if isinstance(node, torch.Tensor):
        key = path or "root"
        while key in tensors:  # two paths can spell alike ("0" vs 0): keep every tensor
            key += "'"
        tensors[key] = node.detach().to("cpu", copy=True)  # a copy: safetensors refuses shared storage
        return {"$tensor": key}
    if isinstance(node, bool) or node is None or isinstance(node, str):
        return node
    if isinstance(node, enum.Enum):  # setup, not state: the running process keeps its own
        return _skipped(node, path, skip)
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return node if math.isfinite(node) else {"$float": repr(node)}
    if isinstance(node, np.generic):
        return _encode(node.item(), path, tensors, skip)
    if isinstance(node, np.ndarray):
        return {"$ndarray": {"dtype": str(node.dtype), "shape": list(node.shape), "data": node.ravel().tolist()}}
    if isinstance(node, dict):
        if all(isinstance(k, str) and k not in TAGS for k in node):
            return {k: _encode(v, f"{path}.{k}" if path else k, tensors, skip) for k, v in node.items()}
        return {"$items": [[_encode(k, path, {}, False), _encode(v, f"{path}.{k}" if path else str(k), tensors, skip)]
                           for k, v in node.items()]}
    if isinstance(node, (list, tuple)):
        items = [_encode(v, f"{path}.{i}" if path else str(i), tensors, skip) for i, v in enumerate(node)]
        return {"$tuple": items} if isinstance(node, tuple) else items
    return _skipped(node, path, skip)


def _skipped(node, path: str, skip: bool):
    if not skip:
        raise TypeError(f"cannot store {type(node).__name__} at {path or 'the top'} without pickle")
    return {"$skipped": type(node).__name__}


def _decode(node, tensors: dict, like, where: str):
    if isinstance(node, list):
        return [_decode(v, tensors, _child(like, i), where) for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    if "$tensor" in node:
        if node["$tensor"] not in tensors:
            raise ValueError(f"{where}: tensor {node['$tensor']!r} is missing from {where}.safetensors")
        return tensors[node["$tensor"]]
    if "$tuple" in node:
        return tuple(_decode(v, tensors, _child(like, i), where) for i, v in enumerate(node["$tuple"]))
    if "$items" in node:
        out = {}
        for k, v in node["$items"]:
            key = _decode(k, tensors, None, where)
            out[key] = _decode(v, tensors, _child(like, key), where)
        return out
    if "$float" in node:
        return float(node["$float"])
    if "$ndarray" in node:
        a = node["$ndarray"]
        return np.asarray(a["data"], dtype=a["dtype"]).reshape(a["shape"])
    if "$skipped" in node:
        if like is None:
            raise ValueError(f"{where}: a {node['$skipped']} was not stored and this run has none to use")
        return like
    return {k: _decode(v, tensors, _child(like, k), where) for k, v in node.items()}


def _child(like, key):
    try:
        return like[key]
    except (KeyError, IndexError, TypeError):
        return None


# ---- RNG states --------------------------------------------------------------------------------------
def rng_state() -> dict:
    """Every generator the loop may draw from: Python's, NumPy's, torch's CPU and CUDA ones."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
