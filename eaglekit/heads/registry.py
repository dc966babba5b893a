"""One registry of head classes, by kind, and what is asked of a kind before a head exists."""
from __future__ import annotations

import torch

from eaglekit.heads.base import DraftHead
from eaglekit.heads.config import KINDS, HeadConfig
from eaglekit.heads.dflash import DFlash2Head, DFlashHead
from eaglekit.heads.dspark import DSparkHead
from eaglekit.heads.eagle1 import Eagle1Head
from eaglekit.heads.eagle3 import Eagle3Head, PEagleHead
from eaglekit.heads.mtp import MtpHead

HEADS: dict[str, type[DraftHead]] = {cls.kind: cls for cls in (Eagle1Head, Eagle3Head, PEagleHead, DFlashHead,
                                                        DSparkHead, DFlash2Head, MtpHead)}
assert tuple(HEADS) == KINDS, "every kind of HeadConfig has one head class"


def head_class(kind: str) -> type[DraftHead]:
    """The head class of ``kind`` (one of ``KINDS``)."""
    if kind not in HEADS:
        raise ValueError(f"unknown head kind {kind!r}; choose one of {', '.join(HEADS)}")
    return HEADS[kind]


def tap_layers(kind: str, target, layer_ids=None) -> tuple[int, ...]:
    """The target layers a head of ``kind`` reads (``layer_ids`` or the target's defaults; none for EAGLE-1)."""
    return head_class(kind).tap_layers(target, layer_ids)


def build_head(config: HeadConfig, target, dtype=None, device=None, from_target: bool = True) -> DraftHead:
    """A fresh head for ``config``, on the target's device/dtype unless given, bound to ``target``;
    ``from_target=False``: its own copies of target rows are left unset (a state dict follows)."""
    head = head_class(config.kind)(config)
    head.to(device=device or target.device, dtype=dtype or target.dtype)
    head.bind(target)
    if not from_target:
        return head
    if config.train_embedding:  # the trained copy starts as the target's own embedding
        with torch.no_grad():
            head.embed_tokens.weight.copy_(target.embed_tokens.weight)
    if config.mask_embedding:  # the learned mask vector starts as the row it replaces
        with torch.no_grad():
            head.mask_embedding.copy_(target.embed_tokens.weight[config.mask_token_id])
    return head
