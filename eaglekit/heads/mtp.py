"""MTP head: the multi-token-prediction (next-n) layers a target ships beside its decoder (DeepSeek-V3, GLM-4.5:
``model.layers.{L+k}.*``), the drafter serving engines run for it (vLLM's ``deepseek_mtp``, SGLang's NEXTN).

What an MTP layer computes, as vLLM, SGLang and transformers (``modeling_layers.MtpLayer``) agree:
element t = (the target's last hidden state h_t, after its final norm; token x_{t+1}) at position t,
``z = eh_proj(cat[enorm(E(x_{t+1})), hnorm(h_t)])``, then a decoder layer of the target's own class (its
attention with a KV cache of its own, its MoE), then ``shared_head.norm``; the target's lm_head reads that and
gives the draft for x_{t+2}. The next draft step feeds the normed output back as its h and the drafted token as
its x, through the same layer (the engines reuse one layer for every depth). So the head is an EAGLE-1 shaped
drafter: it reads ``last``, predicts over the whole vocabulary, and drafts trees and chains through
``decode.EagleDrafter`` like every autoregressive head.

The layer is transformers' own ``MtpLayer`` around the target's decoder-layer class (``HeadConfig.mtp_block``),
built from the target's config (``HeadConfig.target_config``); the shipped weights are read by transformers'
``MtpModel.from_pretrained`` (its renames and the target's own weight conversions, MoE experts fused) and copied
in (``load_shipped``, ``init_from_target``). Its attention writes the head's cache through ``BlockCache``; training's
unroll runs it over the steps' keys with the TTT mask (``ttt_mask``), so the objective is the chain the engines draft.
A target that ships no MTP layer gets a fresh one of its own decoder-layer class (trained from scratch).
"""
from __future__ import annotations

import copy
import importlib
import re
from pathlib import Path
from unittest import mock

import torch
import transformers
from safetensors import safe_open
from torch import nn
from transformers import CONFIG_MAPPING
from transformers.modeling_layers import MtpLayer, MtpModel

from eaglekit.heads.base import LastHead
from eaglekit.heads.config import MTP, HeadConfig
from eaglekit.heads.layers import HeadCache, causal_mask, ttt_mask
from eaglekit.heads.ttt_attention import TTTCache


class BlockCache:
    """A head cache (``HeadCache``, a decode row's, a ``RowsStep``) seen through the one method a transformers
    decoder layer calls on its cache: ``update(keys, values, layer_idx)`` → every key and value it holds."""

    def __init__(self, cache):
        self.cache = cache

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.cache.update(layer_idx, key_states, value_states)


def mtp_config(config: HeadConfig):
    """The transformers config the MTP layers are built from: the target's, through its ``get_mtp_config`` where
    it has MTP layers (their count, their own layer and MLP types); else (an MTP layer trained from scratch for a
    target that ships none) the target's with as many layers, each a full-attention one. On SDPA with the head's
    additive masks."""
    data = dict(config.target_config)
    cfg = CONFIG_MAPPING[data["model_type"]].from_dict(data)
    if getattr(cfg, "num_mtp_layers", None) is not None:
        cfg.num_mtp_layers = config.num_layers
        cfg = cfg.get_mtp_config()
    else:
        cfg.num_hidden_layers = config.num_layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = ["full_attention"] * config.num_layers
    cfg._attn_implementation = "sdpa"
    # an MoE block's experts as transformers' MtpModel runs them (grouped matmuls where torch has them)
    cfg._experts_implementation = "grouped_mm" if hasattr(torch, "_grouped_mm") else "eager"
    return cfg


def block_class(path: str) -> type[nn.Module]:
    """The transformers class ``module:Class`` (``HeadConfig.mtp_block``, ``mtp_rotary``)."""
    module, _, name = path.partition(":")
    if not module.startswith("transformers.") or not name:
        raise ValueError(f"HeadConfig: MTP classes must be transformers' 'module:Class', got {path!r}")
    return getattr(importlib.import_module(module), name)


def init_weights(layers: nn.Module, cfg, layer_cls: type) -> None:
    """Initialise ``layers`` as the target's model class would (its ``_init_weights``): parameters a module makes
    with ``torch.empty`` (an MoE block's experts, its router) are otherwise whatever memory held."""
    module = importlib.import_module(layer_cls.__module__)
    name = layer_cls.__name__.removesuffix("DecoderLayer") + "PreTrainedModel"
    pretrained = getattr(module, name, None) or next(
        v for k, v in vars(module).items() if isinstance(v, type) and k.endswith("PreTrainedModel"))
    plain = copy.deepcopy(cfg)
    plain._experts_implementation = None  # a model class without experts refuses the setting
    model = pretrained(plain)
    with torch.no_grad():
        for m in layers.modules():
            model._init_weights(m)


class MtpHead(LastHead):
    kind = MTP
    # how the model card names it and the engines serve it (eaglekit.export.hub; no export layout yet)
    display_name, vllm_method, sglang_algorithm, speculators_model = "MTP", "mtp", "NEXTN", None

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        cfg = mtp_config(config)
        layer_cls = block_class(config.mtp_block)
        with torch.device("meta"):  # what transformers' MtpModel takes as the norm: the block's first norm's class
            probe = layer_cls(cfg, 0)
        norm_cls = next(type(m) for name, m in probe.named_modules() if "norm" in name)
        self.layers = nn.ModuleList([MtpLayer(cfg, layer_cls, norm_cls, k) for k in range(config.num_layers)])
        init_weights(self.layers, cfg, layer_cls)
        # the target's RoPE, made from its config (its buffers are not saved): what MtpModel borrows from the target,
        # which offline training loads without its decoder
        self.rotary_emb = block_class(config.mtp_rotary)(cfg) if config.mtp_rotary else None

    def init_from_target(self, target) -> None:
        """Start from the MTP layers the target's checkpoint ships (``load_shipped``): fine-tuning them."""
        load_shipped(self, target)

    def step(self, input_ids, g, position_ids, cache=None, attn_mask=None):
        """→ (the layer's normed output [B, S, H], fed back as the next step's h; logits over the target vocabulary
        through the target's lm_head). One MTP layer drafts every depth, as the engines run it."""
        self._check_step(input_ids, g, position_ids, cache, attn_mask)
        dtype, dev = self.dtype, self.device
        S = input_ids.shape[1]
        if isinstance(cache, TTTCache):  # training's unroll: every step's keys kept, its anchored pattern a mask
            if cache.rows is not None:
                raise ValueError("MtpHead: training an MTP head takes every position at every step (no anchors)")
            cache = cache.__dict__.setdefault("mtp", HeadCache())
            attn_mask = ttt_mask(S, cache.length // S, dtype, dev)
        past = cache.length if cache is not None else 0
        # always a mask: a transformers attention given none is causal from the first key, not after the cache
        mask = causal_mask(S, past, dtype, dev) if attn_mask is None else attn_mask.to(dev, dtype)
        pos = position_ids.to(dev)
        e = self.embed(input_ids)
        rope = None if self.rotary_emb is None else self.rotary_emb(e, pos)
        # positional: the cache argument is `cache` in transformers 5.24+, `past_key_values` in 5.17
        out = self.layers[0](e, g.to(dtype), rope, mask, pos, None if cache is None else BlockCache(cache))
        lm_head = self.target_module("lm_head")
        return out, lm_head(out.to(lm_head.weight.device, lm_head.weight.dtype))


def shipped_head(target, path=None) -> MtpHead:
    """An MTP head holding the MTP layers the target's checkpoint ships (``head=mtp`` on the command line)."""
    head = MtpHead(HeadConfig.from_target(target, kind=MTP)).to(device=target.device, dtype=target.dtype)
    return load_shipped(head.bind(target), target, path)


# Qwen3.5 / Qwen3-Next's MTP tensors (``mtp.*``), as vLLM's qwen3_5_mtp / qwen3_next_mtp name them -> MtpLayer's
QWEN_NAMES = {"fc.": "eh_proj.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.",
              "norm.": "post_norm.", "layers.0.": "mtp_block."}


def qwen_layout(config: HeadConfig) -> bool:
    """Whether the target keeps its MTP layers as Qwen3.5 / Qwen3-Next do (``mtp.*``, ``mtp_num_hidden_layers``)
    rather than as DeepSeek / GLM's next-n layers (``model.layers.{L+k}.*``, ``num_nextn_predict_layers``)."""
    return "mtp_num_hidden_layers" in (config.target_config or {})


def checkpoint_tensors(folder: Path, keep) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors checkpoint folder whose names ``keep`` accepts."""
    found = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(f, "pt") as r:
            found.update({k: r.get_tensor(k) for k in r.keys() if keep(k)})  # noqa: SIM118 - not a dict
    return found


def load_shipped(head: MtpHead, target, path=None) -> MtpHead:
    """Copy the MTP layers the target's checkpoint at ``path`` (default: where its model was loaded from) ships
    into ``head``: DeepSeek / GLM's ``model.layers.{L + k}.*`` for k < head's layers, read by transformers'
    ``MtpModel`` (renamed into ``MtpLayer``'s names, the target's own weight conversions applied), or Qwen3.5 /
    Qwen3-Next's ``mtp.*`` (``QWEN_NAMES``; transformers drops those at load). A checkpoint without them is one
    error naming the path."""
    model = target.model
    where = str(path or model.config.name_or_path or "")
    if not where:
        raise ValueError("load_shipped: the target was not loaded from a checkpoint folder: pass path=")
    L, n = target.num_layers, head.config.num_layers
    if qwen_layout(head.config):
        return _load_qwen(head, Path(where))
    if not hasattr(MtpModel, "get_mtp_weights_regex"):
        raise ValueError(f"{where}: reading DeepSeek / GLM next-n layers needs transformers 5.24 or later (its "
                         f"MtpModel loader); this is {transformers.__version__}")

    # transformers' MtpModel finding the MTP tensors by their index, whatever depth its model class assumes (61;
    # patched for this read: a subclass would miss the checkpoint renames transformers keeps for MtpModel itself)
    pattern = re.compile("|".join(rf"(^model\.layers\.{L + k}\.)" for k in range(n)))
    regex = mock.patch.object(MtpModel, "get_mtp_weights_regex", staticmethod(lambda main_model: pattern))

    config = model.config
    saved = config.name_or_path, getattr(config, "num_mtp_layers", None)
    config.name_or_path, config.num_mtp_layers = where, n
    try:
        with regex:
            shipped = MtpModel.from_pretrained(model)
    except (RuntimeError, OSError, ValueError) as e:
        raise ValueError(f"{where}: no MTP layers model.layers.{L}..{L + n - 1} to load ({e})") from e
    finally:
        config.name_or_path, config.num_mtp_layers = saved
    with torch.no_grad():
        head.layers.load_state_dict(shipped.layers.state_dict())
    return head


def _load_qwen(head: MtpHead, where: Path) -> MtpHead:
    if head.config.num_layers != 1:
        raise ValueError(f"{where}: {head.config.num_layers} MTP layers in Qwen's layout (fc and its norms shared "
                         "by them): eaglekit reads one")
    found = checkpoint_tensors(where, lambda k: k.startswith("mtp."))
    if not found:
        raise ValueError(f"{where}: no MTP layers (mtp.*) to load")
    state = {}
    for key, value in found.items():
        rest = key[len("mtp."):]
        theirs = next((t for t in QWEN_NAMES if rest.startswith(t)), None)
        if theirs is None:
            raise ValueError(f"{where}: MTP tensor {key} is not one of Qwen's layout (mtp.fc, mtp.pre_fc_norm_*, "
                             "mtp.norm, mtp.layers.0.*)")
        state["0." + QWEN_NAMES[theirs] + rest[len(theirs):]] = value
    try:
        head.layers.load_state_dict(state)
    except RuntimeError as e:  # e.g. an MoE block's experts stored one tensor each: not converted here yet
        raise ValueError(f"{where}: its MTP tensors do not fit a {head.config.mtp_block} block ({e})") from e
    return head
