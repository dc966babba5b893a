"""The export layouts serving engines load: their exact weight key sets, how eaglekit's names map onto
them, which heads each can hold, and reading a layout folder back into a HeadConfig (docs/exports.md).

- ``vllm``: vLLM's EAGLE-3 layout — ``architectures: ["LlamaForCausalLMEagle3"]``, ``midlayer.*`` keys,
  ``d2t``/``t2d``; tap ids (layer inputs) at the top level and in ``eagle_config``.
- ``sglang``: the same weights; tap ids only in ``eagle_config``, in SGLang's meaning (layer outputs =
  eaglekit's id - 1). SGLang has no ``norm_before_residual``, so such heads are refused.
- ``speculators``: vllm-project/speculators' format (``layers.N.*`` keys, the target's
  ``embed_tokens.weight``, the verifier's Hub id), read by speculators and by vLLM.
- ``eagle1``: SafeAILab/EAGLE's EAGLE-1 draft (``fc`` with bias, ``layers.N.*``, no input norm on
  layer 0, the target's ``embed_tokens.weight``).

Where each engine reads what is data in ``export.engines``. Engines skip weight names they do not know,
so every layout is checked against the exact expected key set, shapes and dtypes (from the config
alone); export.formats writes them, ``validate_export`` checks a written folder.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors import safe_open

from eaglekit.export.dflash_layout import DFLASH_ARCH, check_dflash_fields, dflash_head_config, dflash_weights
from eaglekit.export.engines import (
    ENGINES,
    HEAD_FLAGS,
    LAYOUT_ENGINES,
    NORM_FLAGS,
    TAP_KEY,
    ExportError,
    need,
    read_flag,
    read_tap_count,
    read_taps,
)
from eaglekit.heads.config import DFLASH, EAGLE1, EAGLE3, MTP, PEAGLE, HeadConfig, target_rope
from eaglekit.heads.io import CONFIG, WEIGHTS, read_config

LAYOUTS = ("sglang", "vllm", "speculators", "eagle1")
TAPPED = (EAGLE3, PEAGLE)  # the kinds with EAGLE-3's network: fused taps, midlayer/layers keys, d2t/t2d
ENGINE_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
PEAGLE_ARCH = "PEagleSpeculator"  # speculators' P-EAGLE class name (speculators/models/peagle/config.py)
EXPORT_BLOCK = "eaglekit_export"  # {"layout", "verifier", "engines"}: what eaglekit wrote, for reading back


def layout_engines(layout: str):
    """The engines that read ``layout`` (export.engines), refusing an unknown layout."""
    if layout not in LAYOUT_ENGINES:
        raise ExportError(f"unknown export layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return [ENGINES[n] for n in LAYOUT_ENGINES[layout]]


def full_vocab(cfg: HeadConfig) -> bool:
    return cfg.draft_vocab_size == cfg.target_vocab_size


# ---- the golden key lists ------------------------------------------------------------------------
def _layer_keys(cfg: HeadConfig, prefix: str, first_eagle3: bool, input_norm: bool) -> dict:
    H, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    width = 2 * H if first_eagle3 else H
    keys = {
        f"{prefix}self_attn.q_proj.weight": [q, width], f"{prefix}self_attn.k_proj.weight": [kv, width],
        f"{prefix}self_attn.v_proj.weight": [kv, width], f"{prefix}self_attn.o_proj.weight": [H, q],
        f"{prefix}mlp.gate_proj.weight": [I, H], f"{prefix}mlp.up_proj.weight": [I, H],
        f"{prefix}mlp.down_proj.weight": [H, I], f"{prefix}post_attention_layernorm.weight": [H],
    }
    if input_norm:
        keys[f"{prefix}input_layernorm.weight"] = [H]
    if first_eagle3:
        keys[f"{prefix}hidden_norm.weight"] = [H]
    return keys


def expected_weights(layout: str, cfg: HeadConfig) -> dict[str, tuple[list[int], str]]:
    """{name: (shape, dtype kind)} with kind "float", "int64" or "bool" — exactly what ``layout`` holds."""
    H, V, Vd = cfg.hidden_size, cfg.target_vocab_size, cfg.draft_vocab_size
    layout_engines(layout)
    need(cfg.kind != MTP, f"an MTP head has no {layout} layout: the engines read MTP layers from the target's own "
         "checkpoint; export it with --to checkpoint (a copy of the target's folder holding it)")
    if cfg.kind == DFLASH:  # DFlash's own layout (heads.dflash_layout)
        return dflash_weights(layout, cfg)
    if layout == "eagle1":
        need(cfg.kind == EAGLE1, "the eagle1 layout holds EAGLE-1 heads; use sglang/vllm/speculators for EAGLE-3")
        keys = {"fc.weight": [H, 2 * H], "fc.bias": [H], "embed_tokens.weight": [V, H]}
        for i in range(cfg.num_layers):
            keys.update(_layer_keys(cfg, f"layers.{i}.", False, input_norm=i > 0))
        return {k: (s, "float") for k, s in keys.items()}
    need(cfg.kind in TAPPED, f"the {layout} layout holds EAGLE-3 heads; export EAGLE-1 heads with --to eagle1")
    need(cfg.kind != PEAGLE or layout == "speculators", f"the {layout} layout has no P-EAGLE fields (mask_hidden, "
         "mask_token_id): export a P-EAGLE head with --to speculators (vLLM's parallel drafting reads it)")
    if layout in ("sglang", "vllm"):
        need(cfg.num_layers == 1, f"the {layout} layout has a single midlayer; this head has {cfg.num_layers} "
              "layers (export it with --to speculators)")
        names = ["midlayer."]
    else:
        names = [f"layers.{i}." for i in range(cfg.num_layers)]
    keys = {"fc.weight": [H, len(cfg.aux_layer_ids) * H], "norm.weight": [H], "lm_head.weight": [Vd, H]}
    if cfg.fc_norm:  # EAGLE 3.1: one norm per tap, in fc's column-block order
        keys.update({f"fc_norm.{i}.weight": [H] for i in range(len(cfg.aux_layer_ids))})
    if cfg.norm_before_fc:  # one norm over the concatenated taps (every engine's input_norm)
        keys["input_norm.weight"] = [len(cfg.aux_layer_ids) * H]
    for i, prefix in enumerate(names):
        keys.update(_layer_keys(cfg, prefix, first_eagle3=i == 0, input_norm=True))
    need(not cfg.train_embedding or layout != "sglang", "the sglang layout cannot hold a head with its own "
         "trained embedding (eaglekit has not checked SGLang's loader for it): export it with --to vllm or "
         "--to speculators")
    if layout == "speculators" or cfg.train_embedding:  # vLLM reads a draft's own embedding when present
        keys["embed_tokens.weight"] = [V, H]
    if cfg.kind == PEAGLE:  # speculators' shape; vLLM loads it with view(1, -1)
        keys["mask_hidden"] = [1, 1, len(cfg.aux_layer_ids) * H]
    out = {k: (s, "float") for k, s in keys.items()}
    if not full_vocab(cfg):  # vLLM has no draft_id_to_target_id (and rejects d2t) when Vd == V
        out.update({"d2t": ([Vd], "int64"), "t2d": ([V], "bool")})
    return out


def tensor_kind(t) -> str:
    return {torch.int64: "int64", torch.bool: "bool"}.get(t.dtype, "float" if t.dtype.is_floating_point else str(t.dtype))


def check_weights(layout: str, cfg: HeadConfig, shapes: dict[str, tuple[list[int], str]], where: str,
                  optional=()) -> None:
    """Refuse unless ``shapes`` ({name: (shape, kind)}) is exactly the expected key set for ``layout``
    (names in ``optional`` may be present or absent)."""
    want = {k: v for k, v in expected_weights(layout, cfg).items() if k not in optional}
    shapes = {k: v for k, v in shapes.items() if k not in optional}
    missing, extra = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want))
    wrong = [f"{k}: {list(shapes[k][0])} {shapes[k][1]} (expected {want[k][0]} {want[k][1]})"
             for k in want if k in shapes and (list(shapes[k][0]) != want[k][0] or shapes[k][1] != want[k][1])]
    if missing or extra or wrong:
        raise ExportError(f"{where}: not a valid {layout} layout — missing {missing}, unexpected {extra}, "
                          f"wrong {wrong}")


# ---- what the engines can hold ----------------------------------------------------------------------
def engine_head_config(cfg: HeadConfig, layout: str) -> tuple[HeadConfig, list[int]]:
    """(the HeadConfig as written, the column-block order of ``fc``) for ``layout``'s engines.

    vLLM and SGLang capture each tapped layer once, in layer order, whatever order the ids are given
    in: taps are written sorted and ``fc``'s column blocks permuted to match (the same function);
    a repeated tap cannot be captured twice and is refused. Flags an engine does not implement are
    refused too.
    """
    order = list(range(len(cfg.aux_layer_ids)))
    for engine in layout_engines(layout):
        for flag, only in engine.fixed.items():
            value = getattr(cfg, flag)
            need(value == only, f"the {layout} layout cannot hold this head: {engine.version} does not read "
                 f"{flag} (it always runs {flag}={only}) and this head was trained with {flag}={value}; "
                 "export it with --to vllm or --to speculators")
        if cfg.kind not in TAPPED or not engine.taps_sorted_unique:
            continue
        taps = cfg.aux_layer_ids
        dup = sorted({t for t in taps if taps.count(t) > 1})
        need(not dup, f"the {layout} layout cannot hold this head: its taps {taps} repeat layer(s) {dup}, and "
             f"{engine.version} reads each tapped layer once")
        order = sorted(order, key=lambda i: taps[i])
    if order != sorted(order):
        cfg = dataclasses.replace(cfg, aux_layer_ids=[cfg.aux_layer_ids[i] for i in order])
    return cfg, order


# ---- native <-> layout key names ----------------------------------------------------------------
def rename(name: str, layout: str, to_layout: bool) -> str:
    if layout in ("sglang", "vllm"):
        a, b = ("layers.0.", "midlayer.") if to_layout else ("midlayer.", "layers.0.")
        return b + name[len(a):] if name.startswith(a) else name
    return name  # speculators and eagle1 use eaglekit's own names


def eagle3_fields(cfg: HeadConfig) -> dict:
    """The EAGLE-3 fields every engine config carries; EAGLE 3.1's flags only when set (absent = off for
    every engine, so an EAGLE-3 export stays as it was)."""
    fields = {"draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.hidden_size,
              "norm_before_residual": cfg.norm_before_residual}
    return {**fields, **{flag: True for flag in NORM_FLAGS if getattr(cfg, flag)}}


def detect_layout(config: dict, where: str = "config.json") -> str:
    archs = config.get("architectures") or []
    written = (config.get(EXPORT_BLOCK) or {}).get("layout")
    if written in LAYOUTS:
        return written
    if config.get("speculators_model_type") in ("eagle3", "peagle") or {"Eagle3Speculator", PEAGLE_ARCH} & set(archs):
        return "speculators"
    if DFLASH_ARCH in archs:  # another trainer's DFlash folder: SGLang and vLLM read the same one
        return "sglang"
    if any(a in ENGINE_ARCHS for a in archs):  # tap ids only in eagle_config: SpecForge / SGLang's meaning
        return "vllm" if config.get(TAP_KEY) else "sglang"
    if "LlamaForCausalLM" in archs and config.get("eaglekit", {}).get("kind", EAGLE1) == EAGLE1:
        return "eagle1"
    raise ExportError(f"{where}: not an eaglekit head nor a known export layout (architectures={archs})")


def head_config_of(config: dict, layout: str, target=None, where: str = "config.json") -> HeadConfig:
    """The HeadConfig an export describes: its ``eaglekit`` block, else rebuilt from the engine fields
    (a head trained elsewhere, e.g. by SpecForge; then the target fingerprint cannot be checked)."""
    if "eaglekit" in config:
        return HeadConfig.from_dict(config["eaglekit"], where=f"{where}:eaglekit")
    if DFLASH_ARCH in (config.get("architectures") or []):
        return dflash_head_config(config, target)
    llama = config.get("transformer_layer_config", config)
    theta, scaling = target_rope(_Obj(llama))
    heads = llama["num_attention_heads"]
    kind = EAGLE1 if layout == "eagle1" else PEAGLE if config.get("speculators_model_type") == "peagle" else EAGLE3
    n_target = target.num_layers if target is not None else 0
    aux = None if kind == EAGLE1 else read_taps(config, layout_engines(layout)[0])
    aux = aux or (list(target.default_taps) if target is not None else [])
    return HeadConfig(
        kind=kind, num_layers=llama.get("num_hidden_layers", 1), hidden_size=llama["hidden_size"],
        target_vocab_size=llama["vocab_size"], draft_vocab_size=config.get("draft_vocab_size") or llama["vocab_size"],
        target_num_layers=n_target, aux_layer_ids=aux, num_attention_heads=heads,
        num_key_value_heads=llama.get("num_key_value_heads") or heads,
        head_dim=llama.get("head_dim") or llama["hidden_size"] // heads, intermediate_size=llama["intermediate_size"],
        rms_norm_eps=llama.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=llama.get("max_position_embeddings", 2048),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        **{flag: bool(config.get(flag, False)) for flag in NORM_FLAGS},
        **(peagle_fields_of(config) if kind == PEAGLE else {}),
        # speculators' own default where the field is absent: P-EAGLE trains the embedding, EAGLE-3 does not
        train_embedding=layout == "speculators" and bool(config.get("embed_requires_grad", kind == PEAGLE)),
        target_name=config.get("speculators_config", {}).get("verifier", {}).get("name_or_path", ""))


def peagle_fields_of(config: dict) -> dict:
    """A speculators P-EAGLE config's block (its proposal's speculative tokens) and mask token."""
    methods = config.get("speculators_config", {}).get("proposal_methods") or [{}]
    return {"block_size": int(methods[0].get("speculative_tokens", 1)), "mask_token_id": int(config["mask_token_id"])}


class _Obj:
    def __init__(self, d: dict):
        self.__dict__.update(d)


def check_engine_fields(config: dict, cfg: HeadConfig, layout: str, where) -> None:
    """Each engine of ``layout`` reads back the head's taps, fc width and flags from ``config``."""
    if cfg.kind == DFLASH:
        return check_dflash_fields(config, cfg, layout, where)
    if cfg.kind == PEAGLE:
        check_peagle_fields(config, cfg, where)
    for engine in layout_engines(layout):
        if cfg.kind in TAPPED:
            taps = read_taps(config, engine)
            need(taps == list(cfg.aux_layer_ids), f"{where}: {engine.name} would read taps {taps} "
                 f"(layer inputs) but the head uses {cfg.aux_layer_ids}")
            n = read_tap_count(config, engine)
            need(n == len(cfg.aux_layer_ids), f"{where}: {engine.name} would size fc for {n} taps, "
                 f"the head has {len(cfg.aux_layer_ids)}")
            need("norm_before_residual" in config, f"{where}: missing explicit 'norm_before_residual'")
        for flag in HEAD_FLAGS:
            got = read_flag(config, engine, flag)
            if got is not None and cfg.kind in TAPPED:
                need(got == getattr(cfg, flag), f"{where}: {engine.name} would run {flag}={got}, the head "
                     f"was trained with {getattr(cfg, flag)}")


def check_peagle_fields(config: dict, cfg: HeadConfig, where) -> None:
    """What speculators and vLLM read to run a P-EAGLE head: its model type, the mask token (vLLM's
    ``pard_token``) and a proposal of ``block_size`` tokens (one forward drafts no more)."""
    need(config.get("speculators_model_type") == "peagle" and PEAGLE_ARCH in (config.get("architectures") or []),
         f"{where}: a P-EAGLE export must say speculators_model_type 'peagle' and architectures [{PEAGLE_ARCH!r}]")
    need(config.get("mask_token_id") == cfg.mask_token_id, f"{where}: mask_token_id {config.get('mask_token_id')!r} "
         f"but the head was trained with {cfg.mask_token_id}")
    got = peagle_fields_of(config)["block_size"]
    need(got == cfg.block_size, f"{where}: speculative_tokens {got} but the head drafts a block of {cfg.block_size}")


def validate_export(path, layout: str | None = None, target=None, optional=()) -> tuple[str, HeadConfig]:
    """Check a written export folder: its config and the exact key set/shapes/dtypes of its weights.

    ``optional``: extra weight names tolerated (and ignored) — loading accepts a foreign head's
    ``embed_tokens.weight``; writing tolerates nothing.
    """
    path = Path(path)
    config = read_config(path)
    found = detect_layout(config, where=str(path / CONFIG))
    if layout is not None and layout != found and not ({layout, found} <= {"sglang", "vllm"}
                                                       and EXPORT_BLOCK not in config):
        raise ExportError(f"{path}: expected a {layout} export, found a {found} layout")
    layout = found
    cfg = head_config_of(config, layout, target, where=str(path / CONFIG))
    check_draft_vocab_size(config, cfg, path / CONFIG)
    if "eaglekit" in config and EXPORT_BLOCK in config:  # ours: every engine must read back what the head is
        check_engine_fields(config, cfg, layout, path / CONFIG)
    elif "eaglekit" in config and cfg.kind == EAGLE3:  # an older eaglekit export: top-level fields only
        for key, want in {**eagle3_fields(cfg), TAP_KEY: list(cfg.aux_layer_ids)}.items():
            need(config.get(key) == want, f"{path / CONFIG}: {key}={config.get(key)!r} disagrees with the "
                 f"head ({want!r})")
    f = path / WEIGHTS
    if not f.is_file():
        raise FileNotFoundError(f"{f}: missing weights")
    with safe_open(str(f), framework="pt") as st:
        shapes = {k: (list(st.get_slice(k).get_shape()), _dtype_kind(st.get_slice(k).get_dtype())) for k in st.keys()}  # noqa: SIM118 (safe_open is not iterable)
    if cfg.kind in TAPPED and full_vocab(cfg):  # other trainers may save identity maps; ours omit them
        optional = (*optional, "d2t", "t2d")
    check_weights(layout, cfg, shapes, where=str(f), optional=optional)
    return layout, cfg


def check_draft_vocab_size(config: dict, cfg: HeadConfig, where) -> None:
    """The ``draft_vocab_size`` engines read from the config is the head's (whose d2t check_weights then sizes):
    a hand-edited one would size an engine's maps otherwise. Taps are checked against the target's layers where a
    head is bound to one (heads.config.check_target)."""
    if cfg.kind in TAPPED and "draft_vocab_size" in config:
        need(int(config["draft_vocab_size"]) == cfg.draft_vocab_size, f"{where}: draft_vocab_size "
             f"{config['draft_vocab_size']} but the head's draft vocabulary (d2t) has {cfg.draft_vocab_size} ids")


def _dtype_kind(name: str) -> str:
    return {"I64": "int64", "BOOL": "bool"}.get(name, "float" if name in ("F32", "F16", "BF16", "F64") else name)


