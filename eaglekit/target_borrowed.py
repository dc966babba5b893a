"""A target without its decoder's weights, for offline training: what a head borrows and nothing else.

Training from captured features reads the target's input embedding (the head's token input), its final norm
(EAGLE-3 / DFlash warm starts) and its lm_head (the teacher's argmax and soft targets); the decoder layers,
~90% of a large model's bytes, only ever ran at capture time. So the model is built on the meta device
(shapes, no storage) and those three modules' tensors are read by name from the checkpoint's safetensors
(only the shards that hold them: for a Hub id, only those files are fetched). A forward through such a target
is refused by ``Target.forward``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.utils import cached_file

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def borrowed_modules(model: nn.Module, norm: nn.Module) -> dict[str, nn.Module]:
    """The modules a head borrows, by their names in ``model`` (input embedding, final norm, lm_head)."""
    wanted = {id(model.get_input_embeddings()), id(model.get_output_embeddings()), id(norm)}
    return {name: m for name, m in model.named_modules() if id(m) in wanted}


def checkpoint_files(path: str, keys: list[str], revision: str | None = None) -> dict[str, str]:
    """Which local safetensors file holds each of ``keys`` (a missing key is left out): the checkpoint's
    index when it has one, else its single file; a Hub id fetches only the files named."""
    kw = {"revision": revision, "_raise_exceptions_for_missing_entries": False}
    index = cached_file(path, INDEX, **kw)
    if index:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        shards = {weight_map[k] for k in keys if k in weight_map}
        local = {s: cached_file(path, s, revision=revision) for s in shards}
        return {k: local[weight_map[k]] for k in keys if k in weight_map}
    single = cached_file(path, SINGLE, **kw)
    if not single:
        raise FileNotFoundError(f"{path}: no {SINGLE} or {INDEX}: a target without its decoder is read from "
                                "safetensors (load the whole target instead)")
    with safe_open(single, "pt") as f:
        have = set(f.keys())
    return {k: single for k in keys if k in have}


def load_without_decoder(path: str, config, dtype: torch.dtype, device, attn_implementation: str, norm_of,
                         revision: str | None = None) -> nn.Module:
    """``config``'s causal LM with only the borrowed modules' tensors, on ``device`` in ``dtype``; every other
    tensor stays on the meta device. ``norm_of(model)`` finds the final norm. A tied lm_head shares the
    embedding's tensor, as in the whole model."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    params = {f"{name}.{attr}": (m, attr, p) for name, m in borrowed_modules(model, norm_of(model)).items()
              for attr, p in m.named_parameters(recurse=False)}
    files = checkpoint_files(path, list(params), revision)
    real = {}  # id(meta parameter) -> its Parameter: tied embeddings are one parameter, read once
    for key, (_, _, p) in params.items():
        if id(p) in real or key not in files:
            continue
        with safe_open(files[key], "pt", device="cpu") as f:
            t = f.get_tensor(key)
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{files[key]}: {key} has shape {tuple(t.shape)}, the config says {tuple(p.shape)}")
        real[id(p)] = nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)
    for key, (m, attr, p) in params.items():
        if id(p) not in real:
            raise KeyError(f"{path}: no tensor {key!r} in its safetensors, so the target cannot be loaded without "
                           "its decoder: load it whole (training: data.load_target_decoder=true)")
        setattr(m, attr, real[id(p)])
    return model
