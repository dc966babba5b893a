"""The base of the parallel drafters (P-EAGLE, DFlash): heads whose ONE forward proposes several tokens.

An autoregressive head (EAGLE-1/3) drafts depth d with d forwards; a parallel head fills a block of
``config.block_size`` positions after the last accepted element in one forward, so its drafting cost
per step does not grow with depth. What the decode loop asks of such a head, and nothing more:

- ``parallel = True`` (``DraftHead.parallel`` is False), so decode/ tells the two apart without kinds;
- ``draft_depths``: how many tokens one forward proposes;
- ``new_cache()``: an empty cache for decoding (``.length``, ``.crop(n)``, ``.keep(indices)``);
- ``draft(cache, ids, g, position_ids)`` → logits ``[B, D, Vd]``, one drafter forward.

Element convention (EAGLE's): element t = (target feature of position t, token x_{t+1}) at position t.
``draft`` appends the P pending elements (exact, target-fed) to ``cache`` and returns the draft logits
for x_{t+2} .. x_{t+1+D} where t is the last pending element; the block's own positions are not kept.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from eaglekit.heads.base import DraftHead
from eaglekit.heads.layers import HeadCache


class ParallelHead(DraftHead):
    """A draft head that proposes ``draft_depths`` tokens per forward (see the module docstring)."""

    parallel = True
    vllm_options: ClassVar[dict] = {}  # extra keys of vLLM's --speculative-config for this kind (the model card's)

    @classmethod
    def tokens_per_draft(cls, config) -> int:
        """How many tokens one ``draft`` call of a head with ``config`` proposes (also without a head built:
        the model card's num_speculative_tokens)."""
        raise NotImplementedError

    @property
    def draft_depths(self) -> int:
        """How many tokens one ``draft`` call proposes."""
        return type(self).tokens_per_draft(self.config)

    def new_cache(self) -> HeadCache:
        """An empty cache for decoding; a subclass may return its own HeadCache subclass."""
        return HeadCache(self.config.num_layers)

    def draft(self, cache: HeadCache, ids: torch.Tensor, g: torch.Tensor,
              position_ids: torch.Tensor) -> torch.Tensor:
        """Append the P pending elements (``ids`` [B, P], fused features ``g`` [B, P, H], ``position_ids``
        [B, P]) to ``cache`` and return the draft logits ``[B, draft_depths, Vd]`` for the tokens after the
        last of them; one drafter forward, under ``torch.no_grad()``."""
        raise NotImplementedError

    def _check_draft(self, cache, ids: torch.Tensor, g: torch.Tensor, position_ids: torch.Tensor) -> None:
        """One clear error for a malformed ``draft`` call (shapes of ids, g and position_ids)."""
        if cache is None:
            raise ValueError(f"{type(self).__name__}.draft: a cache is required (head.new_cache())")
        if ids.dim() != 2 or ids.shape[1] < 1:
            raise ValueError(f"{type(self).__name__}.draft: ids must be [B, P] with P >= 1, got {list(ids.shape)}")
        B, P = ids.shape
        if g.shape[:2] != (B, P) or g.shape[-1] != self.config.hidden_size:
            raise ValueError(f"{type(self).__name__}.draft: g must be [{B}, {P}, {self.config.hidden_size}], "
                             f"got {list(g.shape)}")
        if position_ids is None or tuple(position_ids.shape) not in ((B, P), (1, P)):
            got = None if position_ids is None else list(position_ids.shape)
            raise ValueError(f"{type(self).__name__}.draft: position_ids must be [{B}, {P}], got {got}")
