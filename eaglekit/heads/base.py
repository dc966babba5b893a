"""What every head shares: borrowing the target's frozen modules, the draft-vocabulary maps, the step
checks; and the hooks through which each head says how it differs (see ``DraftHead``). ``ParallelHead`` is
the base of the heads whose one forward drafts a block (P-EAGLE, DFlash), with what decoding asks of them.

Saving and the Hub live above this module (heads.io, eaglekit.export.hub), which give ``DraftHead`` its
``save_pretrained`` / ``push_to_hub`` methods; nothing here imports them.
"""
from __future__ import annotations

import zlib
from typing import ClassVar

import torch
from torch import nn

from eaglekit.heads.config import HeadConfig, check_target
from eaglekit.heads.layers import HeadCache, Rotary
from eaglekit.heads.objectives import ttt_loss
from eaglekit.target.borrowed import RowSubset


class DraftHead(nn.Module):
    """Base of Eagle1Head / Eagle3Head.

    The target's ``embed_tokens`` (and EAGLE-1's ``lm_head``) are *borrowed*: kept outside the module
    tree, so they are neither trained, saved, nor moved by ``head.to``; ``bind`` sets them again. With
    ``config.train_embedding`` the head owns ``embed_tokens``, a copy of the target's made by ``build_head``.

    What differs between the kinds is answered by the head class, never by ``if kind == ...`` elsewhere:
    ``tap_layers`` (which target layers it reads), ``reads`` (which target feature ``fuse`` takes:
    ``"taps"`` or ``"last"``), ``fuse``, ``has_draft_vocab``, ``training_features`` (its input noise)
    and ``step_loss`` (its extra loss terms), ``init_from_target`` (its warm start).
    """

    kind: str = ""  # the registry key (HeadConfig.kind)
    reads: str = "taps"  # the TargetOutput field / batch key that fuse() takes
    has_draft_vocab: bool = True  # False: predicts over the whole target vocabulary
    parallel: bool = False  # True: one forward drafts several tokens (heads.base.ParallelHead)
    llama_cpp_spec_type: str | None = None  # llama-server's --spec-type for it (None: llama.cpp has no loader)

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.rotary = Rotary(config)
        self.__dict__["_borrowed"] = {}
        if config.train_embedding:  # filled with the target's rows by build_head; saved, exported, trained
            self.embed_tokens = nn.Embedding(config.target_vocab_size, config.hidden_size)

    # ---- borrowed target modules -------------------------------------------------------------
    def bind(self, target) -> DraftHead:
        check_target(self.config, target, where=f"{type(self).__name__}.bind")
        self._borrowed["embed_tokens"] = target.embed_tokens
        self._borrowed["lm_head"] = target.lm_head
        return self

    def target_module(self, name: str) -> nn.Module:
        """The target's module ``name`` this head borrows (``embed_tokens``, ``lm_head``)."""
        if name not in self._borrowed:
            raise RuntimeError(f"{type(self).__name__} is not bound to a target: call head.bind(target) "
                               "(build_head and load_head do this)")
        return self._borrowed[name]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        emb = self._modules.get("embed_tokens") or self.target_module("embed_tokens")
        table = emb.rows if isinstance(emb, RowSubset) else emb.weight
        return emb(input_ids.to(table.device)).to(self.device, self.dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the head's floating-point weights (read in the decode hot path: cached, see _apply)."""
        return self._placement()[0]

    @property
    def device(self) -> torch.device:
        """Where the head's weights live (cached like ``dtype``)."""
        return self._placement()[1]

    def _placement(self) -> tuple[torch.dtype, torch.device]:
        # scanning the parameters on every read costs a Python loop per step; the answer changes only when
        # the weights are converted or moved, which nn.Module does through _apply (below)
        where = self.__dict__.get("_where")
        if where is None:
            dtype = next(p.dtype for p in self.parameters() if p.is_floating_point())
            where = dtype, next(self.parameters()).device
            self.__dict__["_where"] = where
        return where

    def _apply(self, fn, recurse: bool = True):
        """``.to()`` / ``.float()`` / ``.half()`` / ``.cuda()`` (and a parent module's, which recurse here) go
        through this: forget the cached dtype and device."""
        try:
            return super()._apply(fn, recurse)
        finally:
            self.__dict__["_where"] = None

    # ---- draft vocabulary ----------------------------------------------------------------------
    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary: ``target_id = i + d2t[i]``, ``t2d[t]`` = t is in the draft vocab."""
        # checked on the CPU (the maps may come from a CUDA head or file); copied to the buffers' device below
        d2t, t2d = torch.as_tensor(d2t).flatten().cpu(), torch.as_tensor(t2d).flatten().cpu()
        check_draft_vocab(d2t, t2d, self.config.draft_vocab_size, self.config.target_vocab_size, "set_draft_vocab")
        d2t, t2d = d2t.long(), t2d.bool()
        self.d2t.copy_(d2t.to(self.d2t.device))
        self.t2d.copy_(t2d.to(self.t2d.device))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids of ``target_ids``; -1 where a token is not in the draft vocabulary."""
        inverse = torch.full((self.config.target_vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        inverse[torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t] = \
            torch.arange(self.d2t.numel(), device=self.d2t.device)
        return inverse.to(target_ids.device)[target_ids]

    # ---- what the head reads from the target -----------------------------------------------------
    @classmethod
    def tap_layers(cls, target, layer_ids=None) -> tuple[int, ...]:
        """The target layers whose inputs a head of this kind reads: ``layer_ids`` or the target's
        default taps (EAGLE-1 reads none)."""
        return tuple(layer_ids or target.default_taps)

    @property
    def taps(self) -> tuple[int, ...]:
        """The layers this head reads (pass as ``target.forward(..., layer_ids=head.taps)``)."""
        return tuple(self.config.aux_layer_ids)

    def fuse(self, feature: torch.Tensor) -> torch.Tensor:
        """The target feature named by ``reads`` → the head's input feature g [.., H]."""
        raise NotImplementedError

    def fuse_output(self, target_output) -> torch.Tensor:
        """Fuse what the target returned (``TargetOutput``) into the head's input feature g."""
        feature = getattr(target_output, self.reads, None)
        if feature is None:
            raise ValueError(f"{type(self).__name__}.fuse_output: the target output has no {self.reads!r} "
                             "(run the target with layer_ids=head.taps)")
        return self.fuse(feature)

    # ---- training --------------------------------------------------------------------------------
    def training_features(self, batch: dict, noise: float = 0.0) -> torch.Tensor:
        """g for a training-time-test unroll over ``batch`` (its ``reads`` tensor, fused); ``noise`` is
        EAGLE-1's feature noise (ignored by heads that do not use it)."""
        return self.fuse(batch[self.reads])

    def step_loss(self, ce: torch.Tensor, hidden: torch.Tensor, batch: dict, step: int, valid: torch.Tensor,
                  loss) -> torch.Tensor:
        """TTT step ``step``'s loss from its soft cross-entropy ``ce`` (already weighted by
        ``loss.step_decay ** step``): ``hidden`` is the head's output, ``valid`` the supervised positions,
        ``loss`` the loss settings. The base is the CE alone; EAGLE-1 adds its feature regression."""
        return ce

    def training_loss(self, teacher, batch: dict, loss, *, steps: int, train: bool = True):
        """This kind's training objective over a padded batch → (loss_sum, ``StepStats``), the stats' step k
        being draft depth k+1 for every kind (so held-out accuracy and τ_sim mean the same thing). The base
        is the training-time-test unroll (EAGLE-1/3, ``heads.objectives.ttt_loss``); a parallel drafter
        overrides it with its own block objective. ``steps`` = the depths scored (``loss.ttt_steps``)."""
        return ttt_loss(self, teacher, batch, loss, steps=steps, train=train)

    def init_from_target(self, target) -> None:
        """Warm start from the target's own modules before training (``head.init_from_target``)."""

    def _check_step(self, input_ids, g, position_ids, cache, attn_mask):
        if position_ids is None:
            raise ValueError("step: position_ids [B, S] are required")
        B, S = input_ids.shape
        if g.shape[:2] != (B, S) or g.shape[-1] != self.config.hidden_size:
            raise ValueError(f"step: g must be [{B}, {S}, {self.config.hidden_size}], got {list(g.shape)}")
        if position_ids.shape != (B, S) and position_ids.shape != (1, S):
            raise ValueError(f"step: position_ids must be [{B}, {S}], got {list(position_ids.shape)}")
        if attn_mask is not None:
            past = cache.length if cache is not None else 0
            if attn_mask.dim() != 4 or attn_mask.shape[-2:] != (S, past + S):
                raise ValueError(f"step: attn_mask must be [B or 1, 1, {S}, {past + S}] (cache holds {past}), "
                                 f"got {list(attn_mask.shape)}")
            if attn_mask.dtype == torch.bool:
                raise ValueError("step: attn_mask must be an additive float mask (0 attend, finfo.min blocked)")

    def forward(self, input_ids, g, position_ids, cache=None, attn_mask=None):
        """Same as ``step`` (so DDP/FSDP wrappers can call the head)."""
        return self.step(input_ids, g, position_ids, cache=cache, attn_mask=attn_mask)


class LastHead(DraftHead):
    """The base of the heads that read the target's last hidden state (after its final norm) as it is and predict
    over its whole vocabulary (EAGLE-1, MTP): no taps, identity vocabulary maps (not saved)."""

    reads = "last"
    has_draft_vocab = False

    def __init__(self, config: HeadConfig):
        if config.kind != self.kind:
            raise ValueError(f"{type(self).__name__} needs kind={self.kind!r}, got {config.kind!r}")
        super().__init__(config)
        self.register_buffer("d2t", torch.zeros(config.target_vocab_size, dtype=torch.long), persistent=False)
        self.register_buffer("t2d", torch.ones(config.target_vocab_size, dtype=torch.bool), persistent=False)

    @classmethod
    def tap_layers(cls, target, layer_ids=None) -> tuple[int, ...]:
        return ()  # the last hidden state only

    def fuse(self, last: torch.Tensor) -> torch.Tensor:
        return last.to(self.dtype)

    def set_draft_vocab(self, d2t, t2d) -> None:
        raise ValueError(f"{type(self).__name__} predicts over the full target vocabulary; it has no draft vocabulary")


class ParallelHead(DraftHead):
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

    def row_seed(self, batch: dict, b: int, train: bool) -> int:
        """A seed for sampling training positions of row ``b``: from the sequence's own tokens and (training)
        how many times this head has trained on it, so a run is reproducible whatever the batch or the
        number of processes and the positions move from epoch to epoch; evaluation always gets the same."""
        mask = batch["loss_mask"][b]
        n = int(mask.nonzero().max()) + 1 if bool(mask.any()) else 0
        crc = zlib.crc32(batch["input_ids"][b, :n].cpu().numpy().astype("int64").tobytes())
        visits = self.__dict__.setdefault("_row_visits", {})  # not a module attribute: never saved
        seen = visits.get(crc, 0)
        if train:
            visits[crc] = seen + 1
        return crc * 1_000_003 + (seen if train else 0)

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


def check_draft_vocab(d2t: torch.Tensor, t2d: torch.Tensor, vd: int, v: int, where) -> None:
    """Refuse a draft-vocabulary map an engine would misread, naming ``where`` and the tensor: ``d2t`` [vd] of
    integer offsets (target id = draft id + d2t[draft id]) landing inside the target vocabulary [v], one target id
    per draft id, and ``t2d`` [v] marking exactly those target ids. Absolute ids written where offsets belong are
    named as such."""
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise ValueError(f"{where}: tensor 'd2t' is {d2t.dtype}, expected integer offsets")
    if t2d.is_floating_point() or not bool(((t2d == 0) | (t2d == 1)).all()):
        raise ValueError(f"{where}: tensor 't2d' must be a boolean mask (0/1), got {t2d.dtype}")
    if tuple(d2t.shape) != (vd,):
        raise ValueError(f"{where}: tensor 'd2t' has shape {list(d2t.shape)}, but the draft vocabulary has {vd} "
                         "ids (draft_vocab_size)")
    if tuple(t2d.shape) != (v,):
        raise ValueError(f"{where}: tensor 't2d' has shape {list(t2d.shape)}, but the target vocabulary is {v}")
    d2t, t2d = d2t.long().cpu(), t2d.bool().cpu()
    ids = torch.arange(vd) + d2t
    marked = int(t2d.sum())
    if ids.min() < 0 or ids.max() >= v or not bool(t2d[ids.clamp(0, v - 1)].all()):
        absolute = d2t.min() >= 0 and d2t.max() < v and d2t.unique().numel() == vd and bool(t2d[d2t].all())
        if absolute and vd > 1:
            raise ValueError(f"{where}: tensor 'd2t' holds absolute target ids, not offsets (target id = draft id "
                             "+ d2t[draft id]): write d2t[i] = target_id[i] - i")
        bad = ((ids < 0) | (ids >= v)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"{where}: tensor 'd2t' maps {bad.numel()} draft id(s) outside the target vocabulary "
                             f"0..{v - 1} (draft id {i} -> target id {int(ids[i])})")
        i = int((~t2d[ids]).nonzero().flatten()[0])
        raise ValueError(f"{where}: tensor 't2d' is not d2t's inverse: draft id {i} maps to target id {int(ids[i])}, "
                         "which t2d does not mark")
    if ids.unique().numel() != vd:
        seen: dict = {}
        for i, t in enumerate(ids.tolist()):
            if t in seen:
                raise ValueError(f"{where}: tensor 'd2t' maps two draft ids ({seen[t]} and {i}) to one target id "
                                 f"{t}: a draft vocabulary is one-to-one")
            seen[t] = i
    if marked != vd:
        raise ValueError(f"{where}: tensor 't2d' marks {marked} target ids, but d2t maps {vd} draft ids: they are "
                         "not inverses of each other")
