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
    wanted = {id(model.get_input_embeddings()), id(model.get_output_embeddings())} | ({id(norm)} if norm else set())
    return {name: m for name, m in model.named_modules() if id(m) in wanted}


def checkpoint_files(path: str, keys: list[str], revision: str | None = None) -> dict[str, tuple[str, str]]:
    """Which local safetensors file holds each of ``keys``, and under which name (``stored_name``; a missing key
    is left out): the checkpoint's index when it has one, else its single file; a Hub id fetches only the files
    named."""
    kw = {"revision": revision, "_raise_exceptions_for_missing_entries": False}
    index = cached_file(path, INDEX, **kw)
    if index:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
    else:
        single = cached_file(path, SINGLE, **kw)
        if not single:
            raise FileNotFoundError(f"{path}: no {SINGLE} or {INDEX}: a target without its decoder is read from "
                                    "safetensors (load the whole target instead)")
        with safe_open(single, "pt") as f:
            weight_map = dict.fromkeys(f.keys(), SINGLE)
    names = {k: stored_name(k, weight_map) for k in keys}
    local = {s: cached_file(path, s, revision=revision) if index else single
             for s in {weight_map[n] for n in names.values() if n}}
    return {k: (local[weight_map[n]], n) for k, n in names.items() if n}


def stored_name(key: str, stored) -> str | None:
    """The checkpoint's name for the model's parameter ``key``: the same, else the one stored name that is ``key``
    with one more part (a VL checkpoint keeps ``model.language_model.embed_tokens.weight`` where its causal-LM
    class has ``model.embed_tokens.weight``), else the one with another first part (Nemotron-H's checkpoints keep
    ``backbone.embeddings.weight``, renamed ``model.embeddings.weight`` on load)."""
    if key in stored:
        return key
    parts = key.split(".")
    for same in (lambda k: len(k) == len(parts) + 1 and any(k[:i] + k[i + 1:] == parts for i in range(len(k))),
                 lambda k: len(k) == len(parts) > 1 and k[1:] == parts[1:]):
        found = [k for k in stored if same(k.split("."))]
        if len(found) == 1:
            return found[0]
    return None


def load_without_decoder(path: str, config, dtype: torch.dtype, device, attn_implementation: str, norm_of,
                         revision: str | None = None, auto=AutoModelForCausalLM) -> nn.Module:
    """``config``'s causal LM with only the borrowed modules' tensors, on ``device`` in ``dtype``; every other
    tensor stays on the meta device. ``norm_of(model)`` finds the final norm. A tied lm_head shares the
    embedding's tensor, as in the whole model."""
    with torch.device("meta"):
        model = auto.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    params = {f"{name}.{attr}": (m, attr, p) for name, m in borrowed_modules(model, norm_of(model)).items()
              for attr, p in m.named_parameters(recurse=False)}
    files = checkpoint_files(path, list(params), revision)
    real = {}  # id(meta parameter) -> its Parameter: tied embeddings are one parameter, read once
    for key, (_, _, p) in params.items():
        if id(p) in real or key not in files:
            continue
        file, stored = files[key]
        with safe_open(file, "pt", device="cpu") as f:
            t = f.get_tensor(stored)
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{file}: {stored} has shape {tuple(t.shape)}, the config says {tuple(p.shape)}")
        real[id(p)] = nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)
    for key, (m, attr, p) in params.items():
        if id(p) not in real:
            raise KeyError(f"{path}: no tensor {key!r} in its safetensors, so the target cannot be loaded without "
                           "its decoder: load it whole (training: data.load_target_decoder=true)")
        setattr(m, attr, real[id(p)])
    return model


class RowSubset(nn.Module):
    """Some rows of a frozen [V, H] table (an embedding or an lm_head), looked up by target token id: what
    offline training keeps of the target once every item's teacher argmax is known (``Target.keep_rows``):
    the embedding rows of the tokens its capture holds, the lm_head rows of the draft vocabulary. A row it
    does not hold is an error, never a wrong row; it has no ``weight``, so code that reads the whole table
    fails instead of reading a short one. An lm_head's ``bias`` (Phi, GPT-J) is kept at the same rows
    (``row_bias``, read by ``bias_at``); it has no ``bias`` either."""

    def __init__(self, table: torch.Tensor, ids, what: str, bias: torch.Tensor | None = None):
        super().__init__()
        ids = torch.as_tensor(ids, dtype=torch.long).flatten().unique().cpu()  # sorted, distinct
        if ids.numel() and (ids[0] < 0 or ids[-1] >= table.shape[0]):
            raise ValueError(f"{what}: row ids must lie in 0..{table.shape[0] - 1}")
        index = torch.full((table.shape[0],), -1, dtype=torch.long)
        index[ids] = torch.arange(ids.numel())
        self.register_buffer("rows", table.detach()[ids.to(table.device)].clone(), persistent=False)
        self.register_buffer("index", index.to(table.device), persistent=False)
        row_bias = None if bias is None else bias.detach()[ids.to(bias.device)].clone()
        self.register_buffer("row_bias", row_bias, persistent=False)
        self.what = what

    def __getattr__(self, name: str):
        if name in ("weight", "bias"):  # (a property raising AttributeError would fall through to nn.Module's)
            raise AttributeError(f"{self.what} holds {self.rows.shape[0]} rows of the target's table, not all of "
                                 "it (offline training keeps only the rows it reads: data.keep_target_rows)")
        return super().__getattr__(name)

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        at = self.index[ids.to(self.index.device)]
        if bool((at < 0).any()):
            missing = ids.to(at.device)[at < 0].unique()[:5].tolist()
            raise KeyError(f"{self.what}: token ids {missing} are not among the rows kept (the capture's tokens "
                           "and the draft vocabulary); set data.keep_target_rows=false to keep the whole table")
        return at

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # as an embedding: rows by token id
        return self.rows[self.positions(ids)]

    def bias_at(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The kept bias entries of token ids ``ids`` (an lm_head's), None where the table had no bias."""
        return None if self.row_bias is None else self.row_bias[self.positions(ids)]


def keep_rows(target, embed_ids, lm_head_ids) -> None:
    """Keep only rows ``embed_ids`` of ``target``'s embedding and ``lm_head_ids`` of its lm_head, freeing the
    rest (offline training without the decoder, once each item's teacher argmax is known: the whole lm_head
    is never read again, the embedding only at the capture's tokens). Heads look rows up by id."""
    if target._twins:
        raise RuntimeError(f"{target.name}: keep_rows on a split target or twice")
    emb, out = target.model.get_input_embeddings(), target.model.get_output_embeddings()
    target._twins = {"embed_tokens": RowSubset(emb.weight, embed_ids, f"{target.name}: embedding"),
                     "lm_head": RowSubset(out.weight, lm_head_ids, f"{target.name}: lm_head",
                                          getattr(out, "bias", None))}
    for m in (emb, out):  # shapes stay (configs read them), storage goes
        m.weight = nn.Parameter(m.weight.detach().to("meta"), requires_grad=False)
        if getattr(m, "bias", None) is not None:
            m.bias = nn.Parameter(m.bias.detach().to("meta"), requires_grad=False)
