"""MTP head: the multi-token-prediction (next-n) layers a target ships beside its decoder (DeepSeek-V3, GLM-4.5:
``model.layers.{L+k}.*``; Qwen3.5 / Qwen3-Next: ``mtp.*``; Nemotron-H: ``mtp.layers.*``), the drafter serving
engines run for it (vLLM's ``deepseek_mtp`` / ``qwen3_5_mtp`` / ``nemotron_h_mtp``, SGLang's NEXTN).

What an MTP layer computes, as vLLM, SGLang and transformers (``modeling_layers.MtpLayer``) agree:
element t = (the target's last hidden state h_t, after its final norm; token x_{t+1}) at position t,
``z = eh_proj(cat[enorm(E(x_{t+1})), hnorm(h_t)])``, then a decoder layer of the target's own class (its
attention with a KV cache of its own, its MoE), then ``shared_head.norm``; the target's lm_head reads that and
gives the draft for x_{t+2}. The next draft step feeds the normed output back as its h and the drafted token as
its x, through the same layer (the engines reuse one layer for every depth). So the head is an EAGLE-1 shaped
drafter: it reads ``last``, predicts over the whole vocabulary, and drafts trees and chains through
``decode.EagleDrafter`` like every autoregressive head.

The layer is transformers' own ``MtpLayer`` around the target's decoder-layer class (``HeadConfig.mtp_block``; a
row of them, ``BlockStack``, where the target's MTP layer is several blocks: Nemotron-H's attention then MoE),
built from the target's config (``HeadConfig.target_config``); the shipped weights are read from the checkpoint's
safetensors, renamed into ``MtpLayer``'s names and passed through the target's own weight conversions (MoE experts
fused) (``load_shipped``, ``init_from_target``). Its attention writes the head's cache through ``BlockCache``; training's
unroll runs it over the steps' keys with the TTT mask (``ttt_mask``), so the objective is the chain the engines draft.
A target that ships no MTP layer gets a fresh one of its own decoder-layer class (trained from scratch).
"""
from __future__ import annotations

import copy
import functools
import importlib
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import CONFIG_MAPPING
from transformers.modeling_layers import MtpLayer

from eaglekit.heads.base import LastHead
from eaglekit.heads.config import MTP, HeadConfig
from eaglekit.heads.layers import HeadCache, causal_mask, ttt_mask
from eaglekit.heads.ttt_attention import TTTCache


class BlockCache:
    """A head cache (``HeadCache``, a decode row's, a ``RowsStep``) seen through the one method a transformers
    decoder layer calls on its cache: ``update(keys, values, layer_idx)`` → every key and value it holds."""

    def __init__(self, cache, offset: int = 0):
        self.cache, self.offset = cache, offset  # offset: MTP layer k's block numbers its attention k

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.cache.update(layer_idx - self.offset, key_states, value_states)


def mtp_config(config: HeadConfig):
    """The transformers config the MTP layers are built from: the target's, through its ``get_mtp_config`` where
    it has MTP layers (their count, their own layer and MLP types); else (an MTP layer trained from scratch for a
    target that ships none) the target's with as many layers, each a full-attention one. On SDPA with the head's
    additive masks."""
    data = dict(config.target_config)
    cls = CONFIG_MAPPING[data["model_type"]]
    decode = getattr(cls, "_decode_special_floats", None)  # the JSON form of inf (Nemotron-H's time_step_limit)
    cfg = cls.from_dict(decode(data) if decode else data)
    if getattr(cfg, "num_mtp_layers", None) is not None:
        cfg.num_mtp_layers = config.num_layers
        cfg = cfg.get_mtp_config()
    elif stacked(data):  # each MTP layer's block a row of the target's blocks of these kinds (Nemotron-H)
        cfg.layers_block_type = list(cfg.mtp_layers_block_type)
        cfg.num_hidden_layers = len(cfg.layers_block_type)
        cfg.rms_norm_eps = getattr(cfg, "rms_norm_eps", None) or cfg.layer_norm_epsilon  # what MtpLayer's norms read
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
    pretrained = getattr(module, name, None) or next(  # the module's own (Nemotron-H's layer is a "Block")
        v for k, v in vars(module).items()
        if isinstance(v, type) and k.endswith("PreTrainedModel") and v.__module__ == module.__name__)
    plain = copy.deepcopy(cfg)
    plain._experts_implementation = None  # a model class without experts refuses the setting
    model = pretrained(plain)
    with torch.no_grad():
        for m in layers.modules():
            model._init_weights(m)


class BlockStack(nn.Module):
    """An MTP layer's block made of several of the target's blocks in a row, called as one decoder layer
    (Nemotron-H: ``mtp_layers_block_type``, e.g. attention then MoE, each pre-norm with its residual; vLLM's
    nemotron_h_mtp runs the same, its residual carried across them)."""

    def __init__(self, block_cls: type[nn.Module], config, layer_idx: int = 0):
        super().__init__()
        self.blocks = nn.ModuleList([block_cls(config, j) for j in range(len(config.layers_block_type))])

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                **kwargs):
        cache = cache if cache is not None else past_key_values  # 5.24+ / 5.17 name it differently
        for block in self.blocks:  # the cache positional: its keyword differs between versions too
            hidden_states = block(hidden_states, cache, attention_mask=attention_mask, position_ids=position_ids)
        return hidden_states


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
        block = functools.partial(BlockStack, layer_cls) if stacked(config.target_config) else layer_cls
        self.layers = nn.ModuleList([MtpLayer(cfg, block, norm_cls, k) for k in range(config.num_layers)])
        init_weights(self.layers, cfg, layer_cls)
        # the target's RoPE, made from its config (its buffers are not saved): what MtpModel borrows from the target,
        # which offline training loads without its decoder
        self.rotary_emb = block_class(config.mtp_rotary)(cfg) if config.mtp_rotary else None

    def init_from_target(self, target) -> None:
        """Start from the MTP layers the target's checkpoint ships (``load_shipped``): fine-tuning them."""
        load_shipped(self, target)

    @property
    def walks(self) -> bool:
        """Several MTP layers walked one per draft depth (layer k drafts depth k, each over a cache of its own, its
        element t reading layer k-1's output at t and token t+k+1: DeepSeek's sequential MTP modules), as vLLM's
        multi-module MTP proposer drafts a checkpoint shipping several (``decode.mtp_walk.MtpWalkDrafter``, chains).
        One layer is reused at every depth, feeding its own cache, as every engine drafts a single one."""
        return self.config.num_layers > 1

    def step(self, input_ids, g, position_ids, cache=None, attn_mask=None, layer: int = 0):
        """→ (MTP layer ``layer``'s normed output [B, S, H], fed back as the next step's h; logits over the target
        vocabulary through the target's lm_head). One layer drafts every depth unless the head ``walks``."""
        self._check_step(input_ids, g, position_ids, cache, attn_mask)
        dtype, dev = self.dtype, self.device
        S = input_ids.shape[1]
        if isinstance(cache, TTTCache):  # training's unroll (ttt_unroll): step k is depth k
            if cache.rows is not None:
                raise ValueError("MtpHead: training an MTP head takes every position at every step (no anchors)")
            if self.walks:  # layer k over keys of its own: causal (the unroll shifts their positions alike)
                walked = cache.__dict__.setdefault("mtp_walk", [])
                if len(walked) == self.config.num_layers:
                    raise ValueError(f"MtpHead: {len(walked)} MTP layers walk {len(walked)} depths: train at most "
                                     f"loss.ttt_steps={len(walked)}")
                layer, cache = len(walked), HeadCache()
                walked.append(cache)
            else:  # one layer reused: every step's keys kept, the drafted chain's pattern a mask
                cache = cache.__dict__.setdefault("mtp", HeadCache())
                attn_mask = ttt_mask(S, cache.length // S, dtype, dev)
        past = cache.length if cache is not None else 0
        # always a mask: a transformers attention given none is causal from the first key, not after the cache
        mask = causal_mask(S, past, dtype, dev) if attn_mask is None else attn_mask.to(dev, dtype)
        pos = position_ids.to(dev)
        e = self.embed(input_ids)
        rope = None if self.rotary_emb is None else self.rotary_emb(e, pos)
        block = self.layers[layer]
        offset = 0 if isinstance(block.mtp_block, BlockStack) else layer
        # positional: the cache argument is `cache` in transformers 5.24+, `past_key_values` in 5.17
        out = block(e, g.to(dtype), rope, mask, pos, None if cache is None else BlockCache(cache, offset))
        lm_head = self.target_module("lm_head")
        return out, lm_head(out.to(lm_head.weight.device, lm_head.weight.dtype))


def shipped_head(target, path=None) -> MtpHead:
    """An MTP head holding the MTP layers the target's checkpoint ships (``head=mtp`` on the command line)."""
    head = MtpHead(HeadConfig.from_target(target, kind=MTP)).to(device=target.device, dtype=target.dtype)
    return load_shipped(head.bind(target), target, path)


# the model types whose checkpoints keep MTP layers as mtp.* (vLLM's qwen3_5_mtp / qwen3_next_mtp)
QWEN_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


def layout(config: HeadConfig) -> str:
    """Where the target's checkpoint keeps its MTP layers: ``"qwen"`` (Qwen3.5 / Qwen3-Next: ``mtp.*``,
    ``mtp_num_hidden_layers``), ``"nemotron"`` (Nemotron-H: ``mtp.layers.{P k + j}.*``, each MTP layer P of the
    target's blocks, ``mtp_layers_block_type``) or ``"nextn"`` (DeepSeek / GLM: ``model.layers.{L + k}.*``)."""
    tc = config.target_config or {}
    if "mtp_num_hidden_layers" in tc or tc.get("model_type") in QWEN_TYPES:  # a config saved without it: its type
        return "qwen"
    return "nemotron" if stacked(tc) else "nextn"


def stacked(target_config: dict) -> bool:
    """Whether each MTP layer's block is several of the target's blocks in a row (Nemotron-H ships
    ``mtp_layers_block_type``, attention then MoE, with ``num_nextn_predict_layers``)."""
    return bool(target_config.get("mtp_layers_block_type")) and (target_config.get("num_nextn_predict_layers") or 0) > 0


def renames(config: HeadConfig, num_target_layers: int) -> list[tuple[str, str]]:
    """(checkpoint prefix, the head's prefix) pairs for the MTP layers' tensors, the first match wins; a head
    prefix holding ``.mtp_block.`` is the block's, whose tensors go through the target's weight conversions. As
    vLLM's loaders read them: Qwen's ``mtp.fc`` over cat[pre_fc_norm_embedding, pre_fc_norm_hidden] and
    ``mtp.norm``; DeepSeek's ``enorm, hnorm, eh_proj, shared_head.norm``; Nemotron-H's fusion in its first block and
    ``final_layernorm`` in its last."""
    L, n, kind = num_target_layers, config.num_layers, layout(config)
    if kind == "qwen":
        return [("mtp.fc.", "0.eh_proj."), ("mtp.pre_fc_norm_embedding.", "0.enorm."),
                ("mtp.pre_fc_norm_hidden.", "0.hnorm."), ("mtp.norm.", "0.post_norm."), ("mtp.layers.0.", "0.mtp_block.")]
    pairs = []
    for k in range(n):
        if kind == "nextn":
            first = last = block = f"model.layers.{L + k}."
            blocks, post = [(block, f"{k}.mtp_block.")], "shared_head.norm."
        else:
            P = len(config.target_config["mtp_layers_block_type"])
            first, last = f"mtp.layers.{P * k}.", f"mtp.layers.{P * k + P - 1}."
            blocks = [(f"mtp.layers.{P * k + j}.", f"{k}.mtp_block.blocks.{j}.") for j in range(P)]
            post = "final_layernorm."
        pairs += [(first + name, f"{k}.{name}") for name in ("enorm.", "hnorm.", "eh_proj.")]
        pairs += [(last + post, f"{k}.post_norm."), *blocks]
    return pairs


# the copies of the target's embedding and lm_head DeepSeek ships in each next-n layer: the engines use the target's
NEXTN_COPIES = ("shared_head.head.", "embed_tokens.")


def checkpoint_tensors(folder: Path, keep) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors checkpoint folder whose names ``keep`` accepts."""
    found = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(f, "pt") as r:
            found.update({k: r.get_tensor(k) for k in r.keys() if keep(k)})  # noqa: SIM118 - not a dict
    return found


def convert_weights(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors in the names and layout ``model``'s modules take: transformers' own weight conversions of
    the model's class (an MoE block's experts, stored one tensor each, fused), the direction transformers' loading
    goes and its ``revert_weight_conversion`` undoes. For tensors of a block ``model`` does not hold itself."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, dot_natural_key

    transforms = [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    out, merged = {}, {}
    for key, tensor in sorted(state.items(), key=lambda kv: dot_natural_key(kv[0])):  # expert 2 before expert 10
        for renaming in renamings:
            key, _ = renaming.rename_source_key(key)
        for converter in converters:
            name, pattern = converter.rename_source_key(key)
            if pattern is not None:  # one of many tensors the converter makes one of: collected, converted below
                merged.setdefault(name, copy.deepcopy(converter)).add_tensor(name, key, pattern, tensor)
                break
        else:
            out[key] = tensor
    for name, converter in merged.items():
        for key, value in converter.convert(name, model=model, config=model.config).items():
            out[key] = value[0] if isinstance(value, list) else value
    return out


def load_shipped(head: MtpHead, target, path=None) -> MtpHead:
    """Copy the MTP layers the target's checkpoint at ``path`` (default: where its model was loaded from) ships
    into ``head`` (``renames``: DeepSeek / GLM's ``model.layers.{L + k}.*``, Qwen3.5 / Qwen3-Next's ``mtp.*``,
    Nemotron-H's ``mtp.layers.*``; transformers drops the last two at load). The block's tensors go through the
    target's own weight conversions (``convert_weights``: MoE experts fused as the target's modules hold them). A
    checkpoint without them, or whose tensors do not fit the head's layers, is one error naming the path."""
    where = str(path or target.model.config.name_or_path or "")
    if not where:
        raise ValueError("load_shipped: the target was not loaded from a checkpoint folder: pass path=")
    n, kind = head.config.num_layers, layout(head.config)
    if kind == "qwen" and n != 1:
        raise ValueError(f"{where}: {n} MTP layers in Qwen's layout (fc and its norms shared by them): eaglekit reads one")
    pairs = renames(head.config, target.num_layers)
    found = checkpoint_tensors(Path(where), lambda key: key.startswith(tuple(theirs for theirs, _ in pairs)))
    firsts = {theirs for theirs, ours in pairs if ours.endswith(".eh_proj.")}
    if not all(any(key.startswith(p) for key in found) for p in firsts):
        raise ValueError(f"{where}: no MTP layers {' '.join(sorted(p + '*' for p in firsts))} to load")
    state, block = {}, {}
    for key, value in found.items():
        theirs, ours = next((t, o) for t, o in pairs if key.startswith(t))
        rest = key[len(theirs):]
        if ".mtp_block." not in ours:
            state[ours + rest] = value
        elif not (kind == "nextn" and rest.startswith(NEXTN_COPIES)):
            block[ours + rest] = value
    state.update(convert_weights(target.model, block))
    try:
        head.layers.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{where}: its MTP tensors do not fit {n} {head.config.mtp_block} layer(s) ({e})") from e
    return head
