"""DSpark heads in speculators' ``dspark`` layout (docs/exports.md, "DSpark"): the folder speculators'
DSparkDraftModel loads, and the one llama.cpp's converter turns into the GGUF ``--spec-type draft-dspark``
serves (``--to llama.cpp`` writes this layout, then converts it).

What the readers take from it, read from their sources (speculators 0.9.0 ``models/dspark`` and
``models/dflash``; llama.cpp in llama-cpp-python 0.3.36: ``conversion/qwen.py:DSparkModel``,
``src/models/dflash.cpp:build_dspark_markov_head``, ``common/speculative.cpp``):

- ``architectures: ["DSparkSpeculator"]``, a Qwen3 ``transformer_layer_config`` (the draft layers),
  ``aux_hidden_state_layer_ids`` = eaglekit's taps (layer inputs: llama.cpp writes ``id - 1`` as DFlash's
  layer outputs and extracts ``+ 1``), ``block_size``, ``mask_token_id``, ``draft_vocab_size``,
  ``markov_rank``, ``markov_head_type: vanilla`` (llama.cpp converts no other), ``enable_confidence_head``
  and ``confidence_head_with_markov`` (the confidence head reads [hidden; W1[prev]]).
- ``sample_from_anchor: false``: slot 0 holds the known last token and slots 1..block-1 draft (speculators'
  default for dspark is true, the DeepSeek convention where the anchor slot drafts too; llama.cpp then reads
  the block as [last, mask x n] and chains the bias from slot 1 on, as eaglekit does).
- weights: eaglekit's DFlash names (``fc``, ``hidden_norm``, ``layers.N.*``, ``norm``), the draft lm_head
  rows + ``d2t``/``t2d`` for a draft vocabulary (none for the full one), ``markov_head.markov_w1`` [V, R]
  (indexed by TARGET ids), ``markov_head.markov_w2`` [Vd, R], ``confidence_head.proj`` [1, H + R] + bias.
  No embedding: both readers take the target's.
"""
from __future__ import annotations

from pathlib import Path

import torch

from eaglekit.export.dflash_layout import dflash_state, dflash_weights, shared_lm_head
from eaglekit.export.engines import need
from eaglekit.fileio import write_json, write_safetensors
from eaglekit.heads.config import DSPARK, HeadConfig, check_target
from eaglekit.heads.io import (
    CONFIG,
    WEIGHTS,
    check_finite,
    instantiate,
    read_config,
    read_weights,
    saved_dtype,
)

DSPARK_ARCH = "DSparkSpeculator"
DSPARK_LAYOUTS = ("speculators",)  # folder layouts a dspark head is written in (and llama.cpp through it)
SPECULATORS_VERSION = "0.9.0"
RENAMES = {"markov_w1.weight": "markov_head.markov_w1.weight", "markov_w2.weight": "markov_head.markov_w2.weight",
           "confidence.weight": "confidence_head.proj.weight", "confidence.bias": "confidence_head.proj.bias"}


def refuse_dspark(layout: str) -> None:
    need(layout in DSPARK_LAYOUTS, f"a dspark head is written in speculators' dspark layout (--to speculators) or "
         f"as llama.cpp's draft-dspark GGUF (--to llama.cpp); the {layout} layout has no DSpark reader "
         "(vLLM 0.32.0, eaglekit's checked vLLM, has no DSpark proposer; SGLang's DFlash loader reads no Markov head)")


def dspark_weights(cfg: HeadConfig) -> dict[str, tuple[list[int], str]]:
    """{name: (shape, dtype kind)}: exactly what the layout holds for a dspark head."""
    out = dflash_weights("vllm", cfg)  # the DFlash backbone under the same names, lm_head rows + maps if needed
    R, H = cfg.markov_rank, cfg.hidden_size
    out.update({"markov_head.markov_w1.weight": ([cfg.target_vocab_size, R], "float"),
                "markov_head.markov_w2.weight": ([cfg.draft_vocab_size, R], "float"),
                "confidence_head.proj.weight": ([1, H + R], "float"), "confidence_head.proj.bias": ([1], "float")})
    return out


def dspark_state(head, dtype=None) -> dict[str, torch.Tensor]:
    state = {RENAMES.get(k, k): v for k, v in dflash_state(head).items()}
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
            for k, v in state.items()}


def speculators_fields(cfg: HeadConfig, dtype: str, verifier: str, verifier_architectures, model_type: str,
                       arch: str) -> dict:
    """The fields speculators' DFlash-family configs share (dspark, dflash2): the Qwen3 layer config, the
    verifier, block, taps (layer inputs, as aux_hidden_state_layer_ids), mask token, the anchor not drafting."""
    layer = {
        "model_type": "qwen3", "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.target_vocab_size, "tie_word_embeddings": False, "attention_bias": False,
        "rope_parameters": cfg.rope_parameters(), "rope_theta": cfg.rope_theta, "use_sliding_window": False,
        "layer_types": ["full_attention"] * cfg.num_layers, "dtype": dtype, "torch_dtype": dtype}
    return {
        "architectures": [arch], "speculators_model_type": model_type, "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": model_type, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or [])}},
        "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size, "block_size": cfg.block_size,
        "target_hidden_size": cfg.hidden_size, "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "mask_token_id": cfg.mask_token_id, "sample_from_anchor": False, "sliding_window_non_causal": False,
        "torch_dtype": dtype, "dtype": dtype}


def dspark_config(cfg: HeadConfig, dtype: str, verifier: str, verifier_architectures=()) -> dict:
    return {**speculators_fields(cfg, dtype, verifier, verifier_architectures, DSPARK, DSPARK_ARCH),
            "markov_rank": cfg.markov_rank, "markov_head_type": "vanilla", "enable_confidence_head": True,
            "confidence_head_with_markov": True, "eaglekit": cfg.to_dict()}


def check_dspark_fields(config: dict, where) -> None:
    """What eaglekit's DSpark cannot take from a folder another trainer wrote, refused by name."""
    need(config.get("architectures") == [DSPARK_ARCH], f"{where}: architectures {config.get('architectures')}, "
         f"not [{DSPARK_ARCH!r}]")
    need(config.get("sample_from_anchor") is False, f"{where}: sample_from_anchor={config.get('sample_from_anchor')}"
         " (the anchor slot drafts too); eaglekit's DSpark drafts after the known token (false)")
    need(config.get("markov_head_type", "vanilla") == "vanilla" and int(config.get("markov_rank") or 0) > 0,
         f"{where}: markov_head_type={config.get('markov_head_type')!r} markov_rank={config.get('markov_rank')}; "
         "eaglekit's DSpark is the vanilla Markov head with a rank >= 1")
    need(config.get("enable_confidence_head") is not False and config.get("confidence_head_with_markov") is not False,
         f"{where}: a confidence head reading [hidden; W1[prev]] is required (enable_confidence_head, "
         "confidence_head_with_markov)")


def dspark_head_config(config: dict, target=None) -> HeadConfig:
    """The HeadConfig of a dspark folder: its eaglekit block, else from speculators' fields."""
    if "eaglekit" in config:
        return HeadConfig.from_dict(config["eaglekit"], where="config.json eaglekit")
    layer = config["transformer_layer_config"]
    heads = layer["num_attention_heads"]
    params = dict(layer.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", layer.get("rope_theta", 10000.0)))
    return HeadConfig(
        kind=DSPARK, num_layers=layer["num_hidden_layers"], hidden_size=layer["hidden_size"],
        target_vocab_size=layer["vocab_size"], draft_vocab_size=config["draft_vocab_size"],
        target_num_layers=target.num_layers if target is not None else 0,
        aux_layer_ids=list(config["aux_hidden_state_layer_ids"]), num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads") or heads,
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads, intermediate_size=layer["intermediate_size"],
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6), rope_theta=theta,
        rope_scaling=params if params.get("rope_type", "default") != "default" else None,
        max_position_embeddings=layer.get("max_position_embeddings", 2048), block_size=config["block_size"],
        mask_token_id=config["mask_token_id"], markov_rank=config["markov_rank"])


def _check_keys(state: dict, cfg: HeadConfig, where) -> None:
    want = dspark_weights(cfg)
    have = {k: list(v.shape) for k, v in state.items()}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    wrong = [f"{k} {have[k]} (expected {want[k][0]})" for k in want if k in have and have[k] != want[k][0]]
    need(not (missing or extra or wrong), f"{where}: a dspark folder's weights — missing {missing}, unexpected "
         f"{extra}, wrong shape {wrong}")


def export_dspark(head, out_dir, layout: str, dtype, verifier: str, verifier_architectures, overwrite: bool) -> Path:
    refuse_dspark(layout)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True / --overwrite)")
    state = dspark_state(head, dtype)
    check_finite(state, where=f"export {layout} ({dtype or head.dtype})")
    _check_keys(state, head.config, f"export {layout}")
    config = dspark_config(head.config, str(dtype or head.dtype).removeprefix("torch."), verifier,
                           verifier_architectures)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / WEIGHTS, state)
    write_json(out / CONFIG, config)
    return out


def load_dspark(path, target, dtype=None, device=None):
    """A dspark folder (eaglekit's export or another trainer's) as an eaglekit head bound to ``target``."""
    path = Path(path)
    config = read_config(path)
    check_dspark_fields(config, path / CONFIG)
    cfg = dspark_head_config(config, target)
    check_target(cfg, target, where=str(path))
    state = read_weights(path / WEIGHTS)
    state.pop("embed_tokens.weight", None)
    _check_keys(state, cfg, path / WEIGHTS)
    shared_lm_head(state, cfg, target, path / WEIGHTS)
    if "d2t" not in state:  # a full-vocabulary head: identity maps
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.target_vocab_size, dtype=torch.bool)
    need(cfg.kind == DSPARK, f"{path / CONFIG}: its eaglekit block is a {cfg.kind} head, not a dspark one")
    back = {v: k for k, v in RENAMES.items()}
    state = {back.get(k, k): v for k, v in state.items()}
    return instantiate(cfg, state, target, dtype or saved_dtype(config["transformer_layer_config"], target),
                       device, path / WEIGHTS)
