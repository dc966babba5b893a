"""Write a head in the layouts serving engines load (../shared/formats/EAGLE3.md), and read them back.

- ``sglang`` / ``vllm``: one layout both engines load — ``architectures: ["LlamaForCausalLMEagle3"]``,
  ``midlayer.*`` keys, ``d2t``/``t2d``; every flag vLLM would otherwise default (``norm_before_residual``,
  ``eagle_aux_hidden_state_layer_ids``, ``target_hidden_size``, ``draft_vocab_size``) is written.
  SGLang's head has a single ``midlayer``, so these layouts need a 1-layer head.
- ``speculators``: vllm-project/speculators' own format (``speculators_model_type: eagle3``,
  ``layers.N.*`` keys, plus the target's ``embed_tokens.weight``).
- ``eagle1``: SafeAILab/EAGLE v1 (``fc`` with bias, ``layers.N.*``, no input norm on layer 0).

SGLang silently skips weight names it does not know, so every export is checked against the exact
expected key set, shapes and dtypes (from the config alone, not from the module) before and after
writing; anything else is refused. Each export's config also carries an ``eaglekit`` block (the
HeadConfig) so ``load_head`` can check the target when the folder is loaded back.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from eaglekit.heads.config import EAGLE1, EAGLE3, HeadConfig, target_rope
from eaglekit.heads.io import CONFIG, WEIGHTS, check_target, read_config, write_json, write_safetensors

LAYOUTS = ("sglang", "vllm", "speculators", "eagle1")
ENGINE_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SPECULATORS_VERSION = "0.1.0"


class ExportError(ValueError):
    """An export (or a folder read as one) whose keys, shapes or config do not match its layout."""


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
    if layout == "eagle1":
        _need(cfg.kind == EAGLE1, "the eagle1 layout holds EAGLE-1 heads; use sglang/vllm/speculators for EAGLE-3")
        keys = {"fc.weight": [H, 2 * H], "fc.bias": [H]}
        for i in range(cfg.num_layers):
            keys.update(_layer_keys(cfg, f"layers.{i}.", False, input_norm=i > 0))
        return {k: (s, "float") for k, s in keys.items()}
    _need(cfg.kind == EAGLE3, f"the {layout} layout holds EAGLE-3 heads; export EAGLE-1 heads with --to eagle1")
    if layout in ("sglang", "vllm"):
        _need(cfg.num_layers == 1, f"the {layout} layout has a single midlayer; this head has {cfg.num_layers} "
              "layers (export it with --to speculators)")
        names = ["midlayer."]
    elif layout == "speculators":
        names = [f"layers.{i}." for i in range(cfg.num_layers)]
    else:
        raise ExportError(f"unknown export layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    keys = {"fc.weight": [H, len(cfg.aux_layer_ids) * H], "norm.weight": [H], "lm_head.weight": [Vd, H]}
    for i, prefix in enumerate(names):
        keys.update(_layer_keys(cfg, prefix, first_eagle3=i == 0, input_norm=True))
    if layout == "speculators":
        keys["embed_tokens.weight"] = [V, H]
    out = {k: (s, "float") for k, s in keys.items()}
    out.update({"d2t": ([Vd], "int64"), "t2d": ([V], "bool")})
    return out


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ExportError(msg)


def _kind(t) -> str:
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


# ---- native <-> layout key names ----------------------------------------------------------------
def _rename(name: str, layout: str, to_layout: bool) -> str:
    if layout in ("sglang", "vllm"):
        a, b = ("layers.0.", "midlayer.") if to_layout else ("midlayer.", "layers.0.")
        return b + name[len(a):] if name.startswith(a) else name
    return name  # speculators and eagle1 use eaglekit's own names


def layout_state(head, layout: str, dtype=None) -> dict[str, torch.Tensor]:
    state = {_rename(k, layout, True): v for k, v in head.state_dict().items()}
    if layout == "speculators":
        state["embed_tokens.weight"] = head._target_module("embed_tokens").weight
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu()
            for k, v in state.items()}


# ---- configs --------------------------------------------------------------------------------------
def _llama_fields(cfg: HeadConfig, dtype: str) -> dict:
    return {
        "model_type": "llama", "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.target_vocab_size,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
        "dtype": dtype,  # transformers >= 5 reads `dtype`, older readers `torch_dtype`
    }


def _eagle3_fields(cfg: HeadConfig) -> dict:
    return {"draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "norm_before_residual": cfg.norm_before_residual}


def export_config(cfg: HeadConfig, layout: str, dtype: str, verifier_architectures=None,
                  speculative_tokens: int = 3) -> dict:
    native = {"eaglekit": cfg.to_dict()}
    if layout == "eagle1":
        return {"architectures": ["LlamaForCausalLM"], **_llama_fields(cfg, dtype), **native}
    if layout in ("sglang", "vllm"):
        return {"architectures": ["LlamaForCausalLMEagle3"], **_llama_fields(cfg, dtype), **_eagle3_fields(cfg),
                **native}
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": cfg.target_name, "architectures": list(verifier_architectures or [])},
        },
        "transformer_layer_config": _llama_fields(cfg, dtype),
        **_eagle3_fields(cfg), "torch_dtype": dtype, **native,
    }


# ---- export / validate / load back -----------------------------------------------------------------
def export_head(head, out_dir, layout: str, dtype=None, speculative_tokens: int = 3, overwrite: bool = False,
                verifier_architectures=None) -> Path:
    """Write ``head`` as ``layout`` into ``out_dir`` (config.json + model.safetensors), validated."""
    if layout not in LAYOUTS:
        raise ExportError(f"unknown export layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True / --overwrite)")
    cfg = head.config
    state = layout_state(head, layout, dtype)
    check_weights(layout, cfg, {k: (list(v.shape), _kind(v)) for k, v in state.items()}, where=f"export {layout}")
    dtype_name = str(dtype or head.dtype).removeprefix("torch.")
    config = export_config(cfg, layout, dtype_name, verifier_architectures, speculative_tokens)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / WEIGHTS, state)
    write_json(out / CONFIG, config)
    validate_export(out, layout)
    return out


def detect_layout(config: dict, where: str = "config.json") -> str:
    archs = config.get("architectures") or []
    if config.get("speculators_model_type") == "eagle3" or "Eagle3Speculator" in archs:
        return "speculators"
    if any(a in ENGINE_ARCHS for a in archs):
        return "sglang"
    if "LlamaForCausalLM" in archs and config.get("eaglekit", {}).get("kind", EAGLE1) == EAGLE1:
        return "eagle1"
    raise ExportError(f"{where}: not an eaglekit head nor a known export layout (architectures={archs})")


def head_config_of(config: dict, layout: str, target=None, where: str = "config.json") -> HeadConfig:
    """The HeadConfig an export describes: its ``eaglekit`` block, else rebuilt from the engine fields
    (a head trained elsewhere, e.g. by SpecForge; then the target fingerprint cannot be checked)."""
    if "eaglekit" in config:
        return HeadConfig.from_dict(config["eaglekit"], where=f"{where}:eaglekit")
    llama = config.get("transformer_layer_config", config)
    theta, scaling = target_rope(_Obj(llama))
    heads = llama["num_attention_heads"]
    kind = EAGLE1 if layout == "eagle1" else EAGLE3
    n_target = target.num_layers if target is not None else 0
    aux = config.get("eagle_aux_hidden_state_layer_ids") or ([2, n_target // 2, n_target - 3] if n_target else [])
    return HeadConfig(
        kind=kind, num_layers=llama.get("num_hidden_layers", 1), hidden_size=llama["hidden_size"],
        target_vocab_size=llama["vocab_size"], draft_vocab_size=config.get("draft_vocab_size") or llama["vocab_size"],
        target_num_layers=n_target, aux_layer_ids=aux, num_attention_heads=heads,
        num_key_value_heads=llama.get("num_key_value_heads") or heads,
        head_dim=llama.get("head_dim") or llama["hidden_size"] // heads, intermediate_size=llama["intermediate_size"],
        rms_norm_eps=llama.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=llama.get("max_position_embeddings", 2048),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        target_name=config.get("speculators_config", {}).get("verifier", {}).get("name_or_path", ""))


class _Obj:
    def __init__(self, d: dict):
        self.__dict__.update(d)


def validate_export(path, layout: str | None = None, target=None, optional=()) -> tuple[str, HeadConfig]:
    """Check a written export folder: its config and the exact key set/shapes/dtypes of its weights.

    ``optional``: extra weight names tolerated (and ignored) — loading accepts a foreign head's
    ``embed_tokens.weight``; writing tolerates nothing.
    """
    path = Path(path)
    config = read_config(path)
    found = detect_layout(config, where=str(path / CONFIG))
    if layout is not None and layout != found and not {layout, found} <= {"sglang", "vllm"}:
        raise ExportError(f"{path}: expected a {layout} export, found a {found} layout")
    layout = layout or found
    cfg = head_config_of(config, layout, target, where=str(path / CONFIG))
    if layout != "eagle1" and "eaglekit" in config:  # ours: every flag must be there and agree
        for key, want in _eagle3_fields(cfg).items():
            _need(key in config, f"{path / CONFIG}: missing explicit {key!r}")
            _need(config[key] == want, f"{path / CONFIG}: {key}={config[key]!r} disagrees with the head ({want!r})")
    f = path / WEIGHTS
    if not f.is_file():
        raise FileNotFoundError(f"{f}: missing weights")
    with safe_open(str(f), framework="pt") as st:
        shapes = {k: (list(st.get_slice(k).get_shape()), _dtype_kind(st.get_slice(k).get_dtype())) for k in st.keys()}
    check_weights(layout, cfg, shapes, where=str(f), optional=optional)
    return layout, cfg


def _dtype_kind(name: str) -> str:
    return {"I64": "int64", "BOOL": "bool"}.get(name, "float" if name in ("F32", "F16", "BF16", "F64") else name)


def load_export(path, target, dtype=None, device=None):
    """Load an export folder back into an eaglekit head bound to ``target`` (checked against it)."""
    from eaglekit.heads.io import _instantiate, _read_weights, _saved_dtype

    path = Path(path)
    layout, cfg = validate_export(path, target=target, optional=("embed_tokens.weight",))
    check_target(cfg, target, where=str(path))
    state = {_rename(k, layout, False): v for k, v in _read_weights(path / WEIGHTS).items()}
    state.pop("embed_tokens.weight", None)  # speculators (and some trainers) save the target's embedding
    config = read_config(path)
    saved = config.get("transformer_layer_config", config)
    return _instantiate(cfg, state, target, dtype or _saved_dtype(saved, target), device, path / WEIGHTS)


def export_to(src, dst, layout: str, target, dtype=None, overwrite: bool = False, **kw) -> Path:
    """Load the head in ``src`` (checked against ``target``) and export it to ``dst``."""
    from eaglekit.heads.io import load_head

    head = load_head(src, target)
    archs = list(getattr(target.config, "architectures", None) or [])
    return export_head(head, dst, layout, dtype=dtype, overwrite=overwrite, verifier_architectures=archs, **kw)
