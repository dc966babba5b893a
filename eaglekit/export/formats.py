"""Write a head in the layouts serving engines load, and read any head folder back (docs/exports.md).

The layouts themselves (key sets, renames, what each engine can hold, reading a folder's config) are
export.layouts; this module writes them (``export_head``: checked against the exact expected key set,
shapes and dtypes before and after writing, refused if any weight is non-finite) and loads them
(``load_head``: a native folder, an export, or a head another trainer wrote in an engine's layout).
Each config also carries an ``eaglekit`` block (the HeadConfig) so ``load_head`` can check the target
when the folder is loaded back.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from eaglekit.export.dflash2_layout import DFLASH2_ARCH, export_dflash2, load_dflash2
from eaglekit.export.dflash_layout import (
    DFLASH_ENGINES,
    MASK_FILE,
    dflash_config,
    dflash_state,
    read_mask_file,
    refuse_dflash,
    refuse_lm_head_bias,
    shared_lm_head,
    write_mask_file,
)
from eaglekit.export.dspark_layout import DSPARK_ARCH, export_dspark, load_dspark
from eaglekit.export.engines import (
    ENGINES,
    LAYOUT_ENGINES,
    TAP_KEY,
    get_path,
    refusing_engines,
    set_path,
)
from eaglekit.export.layouts import (
    EXPORT_BLOCK,
    LAYOUTS,
    PEAGLE_ARCH,
    TAPPED,
    ExportError,
    check_weights,
    eagle3_fields,
    engine_head_config,
    full_vocab,
    layout_engines,
    need,
    rename,
    tensor_kind,
    validate_export,
)
from eaglekit.export.mtp_checkpoint import write_checkpoint
from eaglekit.export.verifier import resolve_verifier
from eaglekit.fileio import write_json, write_safetensors
from eaglekit.heads.base import DraftHead
from eaglekit.heads.config import DFLASH, DFLASH2, DSPARK, PEAGLE, HeadConfig, check_target
from eaglekit.heads.io import (
    CONFIG,
    WEIGHTS,
    check_finite,
    check_vocab_maps,
    instantiate,
    is_native,
    load_native,
    read_config,
    read_weights,
    resolve_dir,
    saved_dtype,
)

__all__ = ["EXPORT_BLOCK", "LAYOUTS", "ExportError", "export_config", "export_head", "export_to", "layout_state",
           "load_export", "load_head", "validate_export"]  # the first three and the last also live in export.layouts
LLAMA_CPP = "llama.cpp"  # not a folder layout: a GGUF file written by llama.cpp's converter (eaglekit.engines.llama_cpp)
CHECKPOINT = "checkpoint"  # an MTP head: a copy of the target's checkpoint holding it (export.mtp_checkpoint)
FORMATS = (*LAYOUTS, LLAMA_CPP, CHECKPOINT)  # what `eaglekit export --to` writes
SPECULATORS_VERSION = "0.9.0"  # the speculators release these configs were checked against


def check_finite_head(head: DraftHead, where: str) -> None:
    check_finite(dict(head.state_dict()), where)


def layout_state(head, layout: str, dtype=None, order=None) -> dict[str, torch.Tensor]:
    if head.config.kind == DFLASH:  # its own names, and the lm_head rows vLLM needs (heads.dflash_layout)
        return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu()
                for k, v in dflash_state(head).items()}
    state = {rename(k, layout, True): v for k, v in head.state_dict().items()}
    if order is not None and order != sorted(order):  # fc column blocks in the engines' tap order
        H = head.config.hidden_size
        state["fc.weight"] = torch.cat([state["fc.weight"][:, i * H:(i + 1) * H] for i in order], dim=1)
        if "mask_hidden" in state:  # P-EAGLE: its stand-in for the taps lives in fc's input space too
            m = state["mask_hidden"]
            state["mask_hidden"] = torch.cat([m[i * H:(i + 1) * H] for i in order])
        if head.config.fc_norm:  # each tap's norm moves with its fc block
            norms = [state[f"fc_norm.{i}.weight"] for i in order]
            state.update({f"fc_norm.{j}.weight": w for j, w in enumerate(norms)})
        if head.config.norm_before_fc:  # so does each tap's slice of the one norm over all of them
            w = state["input_norm.weight"]
            state["input_norm.weight"] = torch.cat([w[i * H:(i + 1) * H] for i in order])
    if layout in ("speculators", "eagle1") and not head.config.train_embedding:  # else the head's own is in state
        state["embed_tokens.weight"] = head.target_module("embed_tokens").weight
    if "mask_hidden" in state:  # P-EAGLE: speculators' [1, 1, taps * H]
        state["mask_hidden"] = state["mask_hidden"].reshape(1, 1, -1)
    if head.config.kind in TAPPED and full_vocab(head.config):
        need(not bool(state["d2t"].any()), "a full-vocabulary head must map draft id i to target id i (d2t = 0)")
        state.pop("d2t"), state.pop("t2d")
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


def _write_taps(config: dict, cfg: HeadConfig, layout: str) -> None:
    """Tap ids wherever each of the layout's engines reads them, in that engine's meaning."""
    for engine in layout_engines(layout):
        ids = [t + engine.tap_offset for t in cfg.aux_layer_ids]
        for path in engine.tap_ids_at + tuple(p for p in engine.tap_count_at if p.endswith(TAP_KEY)):
            have = get_path(config, path)
            if have is not None and have != ids:  # two engines of one layout disagree on a key
                raise ExportError(f"{layout}: {path} would be {have} for one engine and {ids} for {engine.name}")
            set_path(config, path, ids)
            parent = path.rsplit(".", 1)[0] if "." in path else ""
            if parent.endswith("eagle_config"):
                set_path(config, f"{parent}.use_aux_hidden_state", True)


def export_config(cfg: HeadConfig, layout: str, dtype: str, verifier: str | None = None,
                  verifier_architectures=None, speculative_tokens: int = 3) -> dict:
    native = {"eaglekit": cfg.to_dict(),
              EXPORT_BLOCK: {"layout": layout, "verifier": verifier,
                             "engines": [ENGINES[n].version for n in LAYOUT_ENGINES[layout]]}}
    if cfg.kind == DFLASH:  # one DFlash layout for both engines (heads.dflash_layout)
        native[EXPORT_BLOCK]["engines"] = [DFLASH_ENGINES[layout].version]
        return {**dflash_config(cfg, dtype), **native}
    if layout == "eagle1":  # SafeAILab's EConfig reads `bias` for fc (default true)
        return {"architectures": ["LlamaForCausalLM"], **_llama_fields(cfg, dtype), "bias": True, **native}
    if layout in ("sglang", "vllm"):
        config = {"architectures": ["LlamaForCausalLMEagle3"], **_llama_fields(cfg, dtype), **eagle3_fields(cfg)}
    else:
        need(bool(verifier), "the speculators layout names its verifier; none given")
        peagle = cfg.kind == PEAGLE  # one forward drafts block_size tokens: the proposal's length
        config = {
            "architectures": [PEAGLE_ARCH if peagle else "Eagle3Speculator"],
            "speculators_model_type": cfg.kind, "speculators_version": SPECULATORS_VERSION,
            **({"mask_token_id": cfg.mask_token_id} if peagle else {}),
            "speculators_config": {
                "algorithm": cfg.kind,
                "proposal_methods": [{"proposal_type": "greedy",
                                      "speculative_tokens": cfg.block_size if peagle else speculative_tokens}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or [])},
            },
            "transformer_layer_config": _llama_fields(cfg, dtype),
            # written out: speculators' P-EAGLE defaults to a trained embedding, its EAGLE-3 to the target's
            "embed_requires_grad": cfg.train_embedding,
            **eagle3_fields(cfg), "torch_dtype": dtype,
        }
    _write_taps(config, cfg, layout)
    return {**config, **native}


# ---- export and load back -------------------------------------------------------------------
def export_head(head, out_dir, layout: str, dtype=None, speculative_tokens: int = 3, overwrite: bool = False,
                verifier_architectures=None, verifier: str | None = None, target_dir=None,
                gguf_type: str = "f16") -> Path:
    """Write ``head`` as ``layout`` into ``out_dir`` (config.json + model.safetensors), validated.

    ``verifier``: the target's id written where engines read it (default: from the head's target
    name, see export.verifier); required by the speculators layout.
    ``layout="llama.cpp"``: the GGUF llama-server drafts with (``out_dir/head-<gguf_type>.gguf``, through
    llama.cpp's converter, eaglekit.engines.llama_cpp), reading the tokenizer from ``target_dir`` (default: the
    folder of the target the head was trained for); the file's path is returned.
    """
    refuse_lm_head_bias(head)  # before any layout's work
    if layout == LLAMA_CPP:
        from eaglekit.engines import llama_cpp
        from eaglekit.target import resolve

        if (why := llama_cpp.refusal(head.config)) is not None:  # before the target's folder is even looked up
            raise ExportError(why)
        if gguf_type not in llama_cpp.GGUF_TYPES:  # before the build is asked which targets it serves
            raise llama_cpp.LlamaCppError(f"gguf type {gguf_type!r}: choose one of {', '.join(llama_cpp.GGUF_TYPES)}")
        target_dir = target_dir or resolve(head.config.target_name)[0]
        if (Path(target_dir) / "config.json").is_file() and (why := llama_cpp.target_refusal(target_dir)):
            raise ExportError(why)
        with tempfile.TemporaryDirectory(prefix="eaglekit-gguf-") as work:  # the layout its converter reads
            if head.config.kind == DSPARK:  # speculators' dspark folder (it names the target as its verifier)
                layout = export_head(head, Path(work) / "dspark", "speculators", verifier=str(target_dir))
            elif head.config.kind == DFLASH2:  # the HF / z-lab folder: the converter reads its nested dflash_config
                layout = export_head(head, Path(work) / "dflash2", "vllm")  # (once llama_cpp.refusal lets it by)
            else:  # EAGLE-3: the vLLM layout
                layout = export_head(head, Path(work) / "vllm", "vllm")
            return llama_cpp.export_gguf(layout, out_dir, target_dir, outtype=gguf_type, overwrite=overwrite)
    layout_engines(layout)
    if head.config.kind == DSPARK:  # its own layout (export.dspark_layout)
        verifier = resolve_verifier(verifier, head.config.target_name, required=True)
        check_finite_head(head, where=f"export {layout}")
        return export_dspark(head, out_dir, layout, dtype, verifier, verifier_architectures, overwrite)
    if head.config.kind == DFLASH2:  # its own layouts (export.dflash2_layout)
        verifier = resolve_verifier(verifier, head.config.target_name, required=layout == "speculators")
        check_finite_head(head, where=f"export {layout}")
        return export_dflash2(head, out_dir, layout, dtype, verifier, verifier_architectures, overwrite)
    if head.config.kind == DFLASH:
        refuse_dflash(head.config, layout)
    refused = refusing_engines(layout, verifier_architectures)
    if refused:  # an engine that cannot tap this target would load the head and fail when serving it
        engine, arch = refused[0]
        raise ExportError(f"layout {layout!r}: {engine.version} cannot capture the taps of a {arch} target, so it "
                          f"could not serve this head (its EAGLE-3 targets: {', '.join(engine.targets)})")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True / --overwrite)")
    written, order = engine_head_config(head.config, layout)
    verifier = resolve_verifier(verifier, head.config.target_name, required=layout == "speculators")
    check_finite_head(head, where=f"export {layout}")
    state = layout_state(head, layout, dtype, order)
    check_finite(state, where=f"export {layout} ({dtype or head.dtype})")  # e.g. overflow in a cast to fp16
    check_weights(layout, written, {k: (list(v.shape), tensor_kind(v)) for k, v in state.items()}, where=f"export {layout}")
    dtype_name = str(dtype or head.dtype).removeprefix("torch.")
    config = export_config(written, layout, dtype_name, verifier, verifier_architectures, speculative_tokens)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / WEIGHTS, state)
    if head.config.kind == DFLASH and head.config.mask_embedding:
        write_mask_file(head, out, dtype)
    else:  # an earlier export's trained mask vector would be read as this head's
        (out / MASK_FILE).unlink(missing_ok=True)
    write_json(out / CONFIG, config)
    validate_export(out, layout)
    return out


def load_export(path, target, dtype=None, device=None):
    """Load an export folder back into an eaglekit head bound to ``target`` (checked against it)."""
    path = Path(path)
    layout, cfg = validate_export(path, target=target, optional=("embed_tokens.weight",))
    check_target(cfg, target, where=str(path))
    state = {rename(k, layout, False): v for k, v in read_weights(path / WEIGHTS).items()}
    if not cfg.train_embedding:  # speculators / eagle1 (and some trainers) save the target's embedding
        state.pop("embed_tokens.weight", None)
    if "mask_hidden" in state:  # P-EAGLE: speculators' [1, 1, taps * H] -> the head's [taps * H]
        state["mask_hidden"] = state["mask_hidden"].reshape(-1)
    check_vocab_maps(state, cfg, path / WEIGHTS)  # before the maps index anything
    if cfg.kind == DFLASH:  # vLLM's layout carries the shared lm_head rows: checked, not loaded
        shared_lm_head(state, cfg, target, path / WEIGHTS)
        if cfg.mask_embedding or (path / MASK_FILE).is_file():  # a trained mask vector beside the weights
            cfg.mask_embedding = True
            state["mask_embedding"] = read_mask_file(path, cfg)
    if cfg.kind in (*TAPPED, DFLASH) and "d2t" not in state:  # a full-vocabulary head: identity maps
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.target_vocab_size, dtype=torch.bool)
    config = read_config(path)
    saved = config.get("transformer_layer_config", config)
    return instantiate(cfg, state, target, dtype or saved_dtype(saved, target), device, path / WEIGHTS)


def load_head(path_or_id, target, dtype=None, device=None, token=None) -> DraftHead:
    """Load a saved head (native folder, Hub id, or an ``eaglekit export`` folder) bound to ``target``."""
    path = resolve_dir(path_or_id, token=token)
    config = read_config(path)
    if is_native(config):
        return load_native(path, target, dtype=dtype, device=device)
    if DSPARK_ARCH in (config.get("architectures") or []):  # speculators' dspark layout (export.dspark_layout)
        return load_dspark(path, target, dtype=dtype, device=device)
    if DFLASH2_ARCH in (config.get("architectures") or []) or config.get("speculators_model_type") == DFLASH2:
        return load_dflash2(path, target, dtype=dtype, device=device)  # either of its layouts
    return load_export(path, target, dtype=dtype, device=device)


def export_to(src, dst, layout: str, target, dtype=None, overwrite: bool = False, verifier: str | None = None,
              **kw) -> Path:
    """Load the head in ``src`` (checked against ``target``) and export it to ``dst``."""
    head = load_head(src, target)
    if layout == CHECKPOINT:
        return write_checkpoint(head, target, dst, dtype=dtype, overwrite=overwrite)
    if layout == LLAMA_CPP:
        from eaglekit.target import resolve

        kw.pop("speculative_tokens", None)
        return export_head(head, dst, layout, overwrite=overwrite, target_dir=resolve(target.name)[0], **kw)
    kw.pop("gguf_type", None)
    archs = list(getattr(getattr(target, "model_config", target.config), "architectures", None) or [])
    return export_head(head, dst, layout, dtype=dtype, overwrite=overwrite, verifier_architectures=archs,
                       verifier=verifier, **kw)
