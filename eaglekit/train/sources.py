"""Where training items come from: offline feature shards or the live target (online), plus the data's
draft vocabulary and the checks that refuse a head that does not fit the features."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eaglekit.config import ConfigError
from eaglekit.data_prep import (
    FeatureDataset,
    OnlineFeatures,
    build_draft_vocab,
    load_draft_vocab,
    load_sharegpt,
    read_conversations,
    tokenize_conversations,
)
from eaglekit.heads import head_class, tap_layers
from eaglekit.train.config import TrainConfig
from eaglekit.train.data import CachedItems, Subset, split_eval


@dataclass
class Sources:
    train: Subset
    eval: Subset
    d2t: torch.Tensor | None  # the data's draft vocabulary (None for a head without one: EAGLE-1)
    t2d: torch.Tensor | None
    layer_ids: tuple[int, ...]  # the taps the head reads and the features carry (none for EAGLE-1)
    where: str

    @property
    def vocab(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.d2t is None else (self.d2t, self.t2d)


def load_conversations(spec: str, limit: int = 0) -> list[dict]:
    """``sharegpt`` (the embedded asset, malformed items skipped) or a path ``read_conversations`` reads."""
    if spec == "sharegpt":
        return list(load_sharegpt(limit=limit or None))
    return list(read_conversations(spec, limit=limit or None))


def check_features(kind: str, feature_kind: str, feature_layers, head_layers, hidden_size: int,
                   feature_hidden: int, where: str) -> None:
    """Refuse features that cannot train this head (it reads taps they lack), naming what differs."""
    if head_layers and not feature_layers:
        raise ConfigError(f"{where}: head.kind={kind} reads taps {list(head_layers)}, but these features were "
                          f"captured for {feature_kind} (no 'taps'); recapture with kind={kind} or set "
                          f"head.kind={feature_kind}")
    if head_layers and list(feature_layers) != list(head_layers):
        raise ConfigError(f"{where}: features tap layers {list(feature_layers)} but head.aux_layer_ids is "
                          f"{list(head_layers)}; they must match")
    if feature_hidden != hidden_size:
        raise ConfigError(f"{where}: features have hidden size {feature_hidden}, the target has {hidden_size}")


def build_sources(cfg: TrainConfig, target) -> Sources:
    """The training and held-out items for ``cfg`` (shards or the live target) and the data's draft vocabulary."""
    d, kind = cfg.data, cfg.head.kind
    head_layers = tap_layers(kind, target, cfg.head.aux_layer_ids)
    if d.features_dir:
        where = str(d.features_dir)
        source = FeatureDataset(d.features_dir, target)
        m = source.manifest
        check_features(kind, m["kind"], m["layer_ids"], head_layers, target.hidden_size, m["hidden_size"], where)
        lengths = list(source.lengths)
    else:
        where = str(d.conversations)
        convs = load_conversations(d.conversations, d.num_conversations)
        samples, _ = tokenize_conversations(target.tokenizer, convs, d.max_length)
        if not samples:
            raise ConfigError(f"{where}: no conversation has assistant tokens within max_length={d.max_length}")
        source = OnlineFeatures(target, samples, kind, list(head_layers) or None, where=where)
        if d.cache_online:
            source = CachedItems(source)
        lengths = [len(s["input_ids"]) for s in samples]
    train, held = split_eval(source, lengths, d.eval_samples)
    d2t = t2d = None
    if head_class(kind).has_draft_vocab:
        d2t, t2d = draft_vocab(cfg, target, source, train, lengths)
    return Sources(train, held, d2t, t2d, head_layers, where)


def draft_vocab(cfg: TrainConfig, target, source, train: Subset, lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """``data.draft_vocab`` if given; else the file beside the shards if it has head.draft_vocab_size
    tokens; else counted on the training split (loss-masked token frequencies).

    A vocabulary file used with shards must be the one their manifest records (prepare writes both):
    the one beside the shards is refused otherwise; an explicit ``data.draft_vocab`` is the user's
    choice, so a mismatch there is only warned about."""
    size = min(cfg.head.draft_vocab_size, target.vocab_size)
    beside = Path(cfg.data.features_dir or "") / "draft_vocab.safetensors"
    check = getattr(source, "vocab_mismatch", None)  # offline shards only
    d2t = t2d = None
    if cfg.data.draft_vocab:
        d2t, t2d = load_draft_vocab(cfg.data.draft_vocab)
        problem = check and check(d2t, t2d, cfg.data.draft_vocab)
        if problem:
            print(f"[eaglekit.train] warning: {problem} (used anyway: data.draft_vocab was set explicitly)")
    elif cfg.data.features_dir and beside.exists():
        d2t, t2d = load_draft_vocab(beside)
        problem = check and check(d2t, t2d, beside)
        if problem:
            raise ConfigError(problem)
        if d2t.numel() != size:
            print(f"[eaglekit.train] {beside} has {d2t.numel()} tokens, head.draft_vocab_size={size}: "
                  "counting the training split instead")
            d2t = t2d = None
    if d2t is None:
        base = getattr(source, "source", source)
        samples = getattr(base, "samples", None)
        tokens = ([samples[i] for i in train.indices] if samples is not None else
                  ({"input_ids": it["input_ids"], "loss_mask": it["loss_mask"]} for it in (train[i] for i in range(len(train)))))
        d2t, t2d = build_draft_vocab(tokens, size, target.vocab_size)
    if d2t.numel() != size or t2d.numel() != target.vocab_size:
        raise ConfigError(f"draft vocabulary has {d2t.numel()} tokens over a {t2d.numel()}-token vocab; "
                          f"head.draft_vocab_size={size} and the target vocab is {target.vocab_size}")
    return d2t, t2d
