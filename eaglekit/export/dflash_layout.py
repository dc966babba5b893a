"""DFlash heads in the layout SGLang's and vLLM's DFlash loaders read (docs/exports.md, "DFlash"): the
exact key set, the config, what each engine reads back from it, and what it cannot hold.

One layout serves both engines (``--to sglang`` / ``--to vllm``): ``architectures: ["DFlashDraftModel"]``,
a Qwen3 decoder config, ``dflash_config {target_layer_ids, mask_token_id, block_size}``, and the weights
``fc``, ``hidden_norm``, ``layers.N.*`` (with ``q_norm`` / ``k_norm``), ``norm`` — eaglekit's own names.
No embedding: both engines embed with the target's. The lm_head: SGLang's DFlash model has none (it drafts
over the target's whole lm_head), vLLM's takes ``lm_head.weight`` + ``d2t`` for a draft vocabulary.

Every fact below was read from the engines' sources (``DFLASH_ENGINES[...].sources``). DFlash's
``target_layer_ids`` count layer OUTPUTS (HF ``hidden_states[id + 1]``), so eaglekit's tap k (the input
of layer k) is written as k - 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from eaglekit.export.engines import TAP_KEY, ExportError, get_path, need
from eaglekit.fileio import atomic_write
from eaglekit.heads.config import DFLASH, HeadConfig, target_rope

DFLASH_ARCH = "DFlashDraftModel"
# a trained mask vector (head.mask_embedding) beside the weights: {"mask_token_id": id, "embedding": [H]}, which
# vLLM's DFlash loader puts in place of the embedding row of mask_token_id (qwen3_dflash.py:_read_mask_embedding)
MASK_FILE = "mask_embedding.pt"
DFLASH_LAYOUTS = ("sglang", "vllm")
TARGET_LAYERS = "dflash_config.target_layer_ids"


@dataclass(frozen=True)
class DFlashEngine:
    name: str
    version: str
    own_lm_head: bool  # it loads lm_head.weight (+ d2t) for a draft vocabulary; else it shares the target's
    taps_at: tuple[tuple[str, int], ...]  # (config path, + offset to eaglekit's meaning), first present wins
    block_at: tuple[str, ...]  # where it reads the block size ((): from the serve command)
    default_block: int | None
    mask_at: tuple[str, ...]  # where it reads the mask token id
    causal: str  # its rule for which draft layers run causal (``engine_causal_layers``); DFlash trains bidirectional
    notes: tuple[str, ...] = ()
    sources: dict = field(default_factory=dict)


DFLASH_ENGINES: dict[str, DFlashEngine] = {e.name: e for e in [
    DFlashEngine(
        "vllm", "vLLM main @ 036a00d (vllm-project/vllm, method 'dflash')", own_lm_head=True,
        taps_at=((TAP_KEY, 0), (TARGET_LAYERS, 1)), block_at=(), default_block=None,
        mask_at=("dflash_config.mask_token_id", "eagle_config.mask_token_id", "mask_token_id"),
        causal="vllm",
        notes=("the block is 1 + num_speculative_tokens of the --speculative-config, not read from the file",
               ("names without 'lm_head' get 'model.'; d2t -> draft_id_to_target_id, t2d skipped; "
                "embed_tokens and lm_head optional (the target's when absent)")),
        sources={
            "architecture DFlashDraftModel -> qwen3_dflash.DFlashQwen3ForCausalLM": "vllm/model_executor/models/registry.py",
            "taps: eagle_aux_hidden_state_layer_ids, else dflash_config.target_layer_ids + 1":
                "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:get_eagle3_aux_layers_from_config @ 0cfdd2e",
            "context k/v = k_norm(k_proj(hidden_norm(fc(taps)))), RoPE; q/k norms per head; a layer is causal "
            "when is_causal (newer vLLM) or else dflash_config.causal says so, else only if its layer_types "
            "entry is sliding_attention (full_attention stays bidirectional)":
                "vllm/model_executor/models/qwen3_dflash.py:_dflash_layer_causal,precompute_and_store_context_kv @ 036a00d",
            "mask_token_id from eagle_config | dflash_config | top level": "qwen3_dflash.py:DFlashQwen3Model.__init__",
            "lm_head / d2t / embed_tokens optional": "qwen3_dflash.py:DFlashQwen3ForCausalLM.load_weights",
            "query = bonus + num_speculative_tokens mask slots": "vllm/v1/spec_decode/dflash.py:DFlashProposer @ 01046b9",
        }),
    DFlashEngine(
        "sglang", "SGLang main @ 003b23d (sgl-project/sglang, --speculative-algorithm DFLASH)", own_lm_head=False,
        taps_at=((TARGET_LAYERS, 1), ("target_layer_ids", 1)), block_at=("dflash_config.block_size", "block_size"),
        default_block=16, mask_at=("dflash_config.mask_token_id", "mask_token_id"), causal="sglang",
        notes=("the draft model holds no embedding and no lm_head: it drafts over the target's whole vocabulary",
               "unknown weight names are skipped silently (so the key set is checked here)"),
        sources={
            "model: layers.*, fc, hidden_norm, norm; q_norm/k_norm; no embed/lm_head; unknown names skipped":
                "python/sglang/srt/models/dflash.py:DFlashDraftModel,load_weights @ 003b23d",
            "target_layer_ids (layer outputs, captured +1), block_size (dflash_config, then top level, default 16), "
            "mask_token_id": "python/sglang/srt/speculative/dflash_utils.py:parse_dflash_draft_config @ 00731f0",
            "no layer_types: every layer ENCODER_ONLY (bidirectional); full_attention: bidirectional unless "
            "is_causal; sliding_attention: causal (DECODER) unless is_causal is false; other types refused":
                "python/sglang/srt/models/dflash.py:_get_dflash_layer_attention_params",
        }),
]}


# ---- what an engine makes of a config ---------------------------------------------------------------
def engine_taps(config: dict, engine: DFlashEngine) -> list[int] | None:
    """The taps ``engine`` captures, in eaglekit's meaning (layer inputs); None if it finds none."""
    for path, offset in engine.taps_at:
        ids = get_path(config, path)
        if ids:
            return [int(i) + offset for i in ids]
    return None


def engine_block(config: dict, engine: DFlashEngine, speculative_tokens: int | None = None) -> int | None:
    for path in engine.block_at:
        if get_path(config, path) is not None:
            return int(get_path(config, path))
    return engine.default_block if engine.block_at else (None if speculative_tokens is None else speculative_tokens + 1)


def engine_mask(config: dict, engine: DFlashEngine) -> int | None:
    return next((int(get_path(config, p)) for p in engine.mask_at if get_path(config, p) is not None), None)


def engine_causal_layers(config: dict, engine: DFlashEngine) -> list[bool | None]:
    """Per draft layer: does ``engine`` run it causal (None: a layer type it refuses to load)? The two
    engines read ``layer_types`` differently, so one key set cannot stand for both."""
    n = int(config.get("num_hidden_layers") or 0)
    types = config.get("layer_types")
    is_causal = get_path(config, "is_causal")
    if engine.causal == "vllm":
        override = is_causal if is_causal is not None else get_path(config, "dflash_config.causal")
        if override is not None:
            return [bool(override)] * n
        return [bool(types) and i < len(types) and types[i] == "sliding_attention" for i in range(n)]
    if not types:  # SGLang: no layer_types = every layer bidirectional
        return [False] * n

    def sglang(t):
        if t == "full_attention":
            return bool(is_causal)
        return (True if is_causal is None else bool(is_causal)) if t == "sliding_attention" else None
    return [sglang(types[i]) if i < len(types) else None for i in range(n)]


# ---- what the layout holds and what it cannot ----------------------------------------------------------
def refuse_dflash(cfg: HeadConfig, layout: str) -> None:
    """Refuse, naming the field, what the engines of ``layout`` cannot represent of this head."""
    need(layout in DFLASH_LAYOUTS, f"the {layout} layout holds EAGLE heads; export a dflash head with --to sglang "
         "or --to vllm")
    taps = list(cfg.aux_layer_ids)
    need(min(taps) >= 1, f"aux_layer_ids {taps}: DFlash engines read target_layer_ids as layer outputs, so tap 0 "
         "(the embedding output) has no id")
    need(taps == sorted(set(taps)), f"aux_layer_ids {taps}: the DFlash engines capture each layer once, in layer "
         "order; train with strictly increasing taps")
    need(not cfg.mask_embedding or layout == "vllm", f"head.mask_embedding: {DFLASH_ENGINES[layout].version} fills "
         f"mask slots from the embedding row of mask_token_id and reads no trained mask vector; export with --to vllm "
         f"(it reads {MASK_FILE})")
    if not DFLASH_ENGINES[layout].own_lm_head:
        need(cfg.draft_vocab_size == cfg.target_vocab_size, f"draft_vocab_size {cfg.draft_vocab_size}: "
             f"{DFLASH_ENGINES[layout].version} drafts over the target's whole lm_head "
             f"({cfg.target_vocab_size} tokens); export with --to vllm or train with the full vocabulary")


def dflash_weights(layout: str, cfg: HeadConfig) -> dict[str, tuple[list[int], str]]:
    """{name: (shape, dtype kind)}: exactly what ``layout`` holds for a DFlash head."""
    refuse_dflash(cfg, layout)
    H, I, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    keys = {"fc.weight": [H, len(cfg.aux_layer_ids) * H], "hidden_norm.weight": [H], "norm.weight": [H]}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        keys.update({
            f"{p}self_attn.q_proj.weight": [q, H], f"{p}self_attn.k_proj.weight": [kv, H],
            f"{p}self_attn.v_proj.weight": [kv, H], f"{p}self_attn.o_proj.weight": [H, q],
            f"{p}self_attn.q_norm.weight": [d], f"{p}self_attn.k_norm.weight": [d],
            f"{p}mlp.gate_proj.weight": [I, H], f"{p}mlp.up_proj.weight": [I, H], f"{p}mlp.down_proj.weight": [H, I],
            f"{p}input_layernorm.weight": [H], f"{p}post_attention_layernorm.weight": [H]})
    out = {k: (s, "float") for k, s in keys.items()}
    if cfg.draft_vocab_size != cfg.target_vocab_size:  # vLLM only (refused for SGLang above)
        out.update({"lm_head.weight": ([cfg.draft_vocab_size, H], "float"), "d2t": ([cfg.draft_vocab_size], "int64"),
                    "t2d": ([cfg.target_vocab_size], "bool")})
    return out


def refuse_lm_head_bias(head) -> None:
    """Refuse, naming the bias, a head whose export would carry the rows of a target lm_head that has a
    bias (Phi-1/1.5/2, GPT-J): a DFlash-family head with a draft vocabulary, whose engines load the draft
    lm_head as ``lm_head.weight`` alone (vLLM's DFlash and DSpark: weight + d2t), so they would draft from
    logits the head never trained on."""
    bias_of = getattr(head, "draft_lm_bias", None)
    if bias_of is None or head.config.draft_vocab_size == head.config.target_vocab_size:
        return  # no lm_head in the export: the engine drafts through the target's own
    need(bias_of() is None, f"the target's lm_head has a bias ({head.config.target_name or 'this target'}): a "
         f"{head.config.kind} export with a draft vocabulary carries the lm_head rows as lm_head.weight, which the "
         "engines load without a bias, so they would draft from logits the head was not trained on (a head "
         f"over the whole vocabulary, head.draft_vocab_size={head.config.target_vocab_size}, exports no lm_head)")


def dflash_state(head) -> dict[str, torch.Tensor]:
    """The head's tensors under the layout's names (eaglekit's own), plus the lm_head a draft vocabulary
    needs in vLLM: the target's rows, which the head shares frozen."""
    state = dict(head.state_dict())
    state.pop("mask_embedding", None)  # not a weight of the engines' model files: MASK_FILE (write_mask_file)
    if head.config.draft_vocab_size == head.config.target_vocab_size:
        need(not bool(state["d2t"].any()), "a full-vocabulary head must map draft id i to target id i (d2t = 0)")
        state.pop("d2t"), state.pop("t2d")
    else:
        state["lm_head.weight"] = head.draft_lm_head()
    return state


def write_mask_file(head, out: Path, dtype=None) -> None:
    """``out/MASK_FILE`` for a head with a trained mask vector (vLLM's format), in the export's dtype."""
    vec = head.mask_embedding.detach().cpu()
    vec = vec.to(dtype) if dtype is not None else vec
    atomic_write(out / MASK_FILE, lambda tmp: torch.save({"mask_token_id": head.config.mask_token_id,
                                                          "embedding": vec.clone()}, tmp))


def read_mask_file(path: Path, cfg: HeadConfig) -> torch.Tensor:
    """The trained mask vector [H] of the export folder ``path``, checked against the head's config."""
    f = path / MASK_FILE
    need(f.is_file(), f"{f} is missing: the head was trained with head.mask_embedding")
    state = torch.load(f, map_location="cpu", weights_only=True)
    if isinstance(state, dict):
        need(state.get("mask_token_id", cfg.mask_token_id) == cfg.mask_token_id, f"{f}: mask_token_id "
             f"{state.get('mask_token_id')} but the config's is {cfg.mask_token_id}")
        state = state.get("embedding")
    need(torch.is_tensor(state) and state.numel() == cfg.hidden_size, f"{f}: expected a mask embedding of "
         f"{cfg.hidden_size} values, got {getattr(state, 'shape', type(state).__name__)}")
    return state.reshape(-1)


def dflash_config(cfg: HeadConfig, dtype: str) -> dict:
    """config.json for both engines: a Qwen3 decoder config and the DFlash fields where each reads them."""
    dflash = {"target_layer_ids": [t - 1 for t in cfg.aux_layer_ids], "mask_token_id": cfg.mask_token_id,
              "block_size": cfg.block_size}
    return {
        "architectures": [DFLASH_ARCH], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.target_vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.hidden_size,
        "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
        "num_target_layers": cfg.target_num_layers, "block_size": cfg.block_size, "dflash_config": dflash,
        "torch_dtype": dtype, "dtype": dtype}


def check_dflash_fields(config: dict, cfg: HeadConfig, layout: str, where) -> None:
    """The layout's engine reads back the head's taps, fc width, mask token, block and bidirectional
    attention from ``config``."""
    engine = DFLASH_ENGINES[layout]
    need(config.get("architectures") == [DFLASH_ARCH], f"{where}: {engine.name} loads architectures "
         f"[{DFLASH_ARCH!r}], got {config.get('architectures')}")
    taps = engine_taps(config, engine)
    need(taps == list(cfg.aux_layer_ids), f"{where}: {engine.name} would capture taps {taps} (layer inputs), "
         f"the head reads {cfg.aux_layer_ids}")
    need(engine_mask(config, engine) == cfg.mask_token_id, f"{where}: {engine.name} would fill mask slots with "
         f"token {engine_mask(config, engine)}, the head was trained with mask_token_id={cfg.mask_token_id}")
    block = engine_block(config, engine, speculative_tokens=cfg.block_size - 1)
    need(block == cfg.block_size, f"{where}: {engine.name} would draft blocks of {block}, the head's is "
         f"{cfg.block_size}")
    causal = engine_causal_layers(config, engine)
    need(None not in causal, f"{where}: {engine.name} cannot load layer_types {config.get('layer_types')} for "
         f"{len(causal)} layers (it takes one full_attention / sliding_attention entry per layer)")
    need(not any(causal), f"{where}: {engine.name} would run causal layers {[i for i, c in enumerate(causal) if c]} "
         f"(layer_types {config.get('layer_types')}, is_causal {config.get('is_causal')}); a dflash head attends "
         "bidirectionally inside its block")


def dflash_head_config(config: dict, target=None) -> HeadConfig:
    """The HeadConfig of a DFlash folder another trainer wrote (SpecForge / z-lab layout, no eaglekit block):
    taps from target_layer_ids (+1), the target's lm_head over the whole vocabulary unless a draft one is named."""
    taps = engine_taps(config, DFLASH_ENGINES["sglang"]) or engine_taps(config, DFLASH_ENGINES["vllm"])
    if not taps:
        raise ExportError(f"a {DFLASH_ARCH} config without dflash_config.target_layer_ids")
    theta, scaling = target_rope(_Obj(config))
    heads = config["num_attention_heads"]
    mask = engine_mask(config, DFLASH_ENGINES["sglang"])
    need(mask is not None, f"a {DFLASH_ARCH} config without dflash_config.mask_token_id (the tokenizer's added "
         "mask token is not known here)")
    return HeadConfig(
        kind=DFLASH, num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        target_vocab_size=config["vocab_size"], draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
        target_num_layers=target.num_layers if target is not None else int(config.get("num_target_layers") or 0),
        aux_layer_ids=taps, num_attention_heads=heads, num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads, intermediate_size=config["intermediate_size"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        block_size=engine_block(config, DFLASH_ENGINES["sglang"]), mask_token_id=mask)


def shared_lm_head(state: dict, head_config: HeadConfig, target, where) -> None:
    """Drop a loaded ``lm_head.weight`` after checking it is the target's rows of the draft vocabulary (a
    dflash head shares the target's lm_head; it cannot hold a trained one)."""
    w = state.pop("lm_head.weight", None)
    if w is None or target is None:
        return
    d2t = state.get("d2t", torch.zeros(head_config.draft_vocab_size, dtype=torch.long))
    rows = target.lm_head.weight.detach()[(torch.arange(d2t.numel()) + d2t).to(target.lm_head.weight.device)]
    need(torch.allclose(w.float().cpu(), rows.float().cpu(), rtol=1e-2, atol=1e-3),
         f"{where}: lm_head.weight differs from the target's lm_head rows; a dflash head shares the target's "
         "lm_head and cannot hold a trained one")


class _Obj:
    def __init__(self, d: dict):
        self.__dict__.update(d)
