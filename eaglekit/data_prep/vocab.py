"""Draft vocabulary: the ``draft_vocab_size`` most frequent target tokens under the loss mask.

``d2t`` int64 [Vd]: target_id = i + d2t[i] (the offset layout SGLang/vLLM EAGLE-3 heads load);
``t2d`` bool [V]: True where a target id is in the draft vocabulary. Draft ids are the chosen target ids
in ascending order, so ``d2t`` is non-decreasing. Frequency ties go to the lower target id; if fewer
distinct tokens were seen than ``draft_vocab_size``, the lowest unseen ids fill the rest (the head's
vocabulary size is a config choice that should not depend on how much data was read).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglekit.data_prep.capture import make_readable
from eaglekit.fileio import atomic_write

VOCAB_FILE = "draft_vocab.safetensors"


def token_counts(samples, vocab_size: int) -> torch.Tensor:
    """int64 [V] counts of ``input_ids`` where ``loss_mask`` is 1, over an iterable of sample dicts."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        ids = torch.as_tensor(s["input_ids"]).long()[torch.as_tensor(s["loss_mask"]).bool()]
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"token id {int(ids.max())} >= vocab_size {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def draft_vocab_from_counts(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab_size}")
    # stable sort by descending count keeps ascending id order among ties
    order = torch.sort(-counts, stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t.long(), t2d


def build_draft_vocab(samples, draft_vocab_size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` from token frequencies under the loss mask of ``samples``."""
    return draft_vocab_from_counts(token_counts(samples, vocab_size), draft_vocab_size)


def save_draft_vocab(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor) -> Path:
    """Write ``d2t``/``t2d`` to ``path`` (a file, or a folder → folder/draft_vocab.safetensors) atomically"""
    path = Path(path)
    if path.is_dir() or not path.suffix:
        path = path / VOCAB_FILE
    tensors = {"d2t": d2t.long().contiguous(), "t2d": t2d.bool().contiguous()}
    meta = {"draft_vocab_size": str(d2t.numel()), "vocab_size": str(t2d.numel())}

    def write(tmp: str) -> None:
        save_file(tensors, tmp, metadata=meta)
        make_readable(Path(tmp))

    return atomic_write(path, write)


def vocab_hash(d2t: torch.Tensor, t2d: torch.Tensor) -> str:
    """sha256 of the vocabulary's content (int64 ``d2t`` bytes, then bool ``t2d`` bytes): the same for
    any file holding it, unlike the file's bytes (safetensors' metadata order is not fixed)."""
    h = hashlib.sha256(d2t.long().contiguous().numpy().tobytes())
    h.update(t2d.bool().contiguous().numpy().tobytes())
    return h.hexdigest()


def vocab_record(d2t: torch.Tensor, t2d: torch.Tensor) -> dict:
    """What a capture manifest records of the draft vocabulary prepared with its shards."""
    return {"file": VOCAB_FILE, "sha256": vocab_hash(d2t, t2d), "size": d2t.numel()}


def load_draft_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` from a file written by ``save_draft_vocab`` (or the folder holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / VOCAB_FILE
    if not path.exists():
        raise FileNotFoundError(f"draft vocabulary not found: {path}")
    t = load_file(str(path))
    d2t, t2d = t["d2t"], t["t2d"]
    ids = torch.arange(d2t.numel()) + d2t
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[ids].all()):
        raise ValueError(f"{path}: d2t and t2d disagree (corrupt draft vocabulary)")
    return d2t, t2d
