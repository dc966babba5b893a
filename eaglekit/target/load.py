"""Loading a target: an embedded name, a local folder, a Hub id or a .gguf file, whole, split over processes
(``tp_size``), spread over devices (``device_map``), with a LoRA adapter, or without its decoder (offline training).

Nothing is refused for its architecture: any causal LM whose forward runs loads, captures and trains. A VL
checkpoint (``...ForConditionalGeneration`` with a ``text_config``) loads through the causal-LM class transformers
maps its config to (Qwen3.5's maps to its language model, weights renamed on load), else whole through the
image-text class, its language model's layers tapped and its embedding and lm_head borrowed; text conversations
never reach its vision tower.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from eaglekit import assets
from eaglekit.config import TargetSpec, parse_dtype
from eaglekit.target import tensor_parallel as tp
from eaglekit.target.architectures import attention_implementation
from eaglekit.target.borrowed import load_without_decoder
from eaglekit.target.model import Target


def resolve(name_or_path: str | Path) -> tuple[str, dict]:
    """Where to load ``name_or_path`` from: an embedded asset, a .gguf file, a local folder or a Hub id."""
    s = str(name_or_path)
    if s in assets.ASSETS:
        return str(assets.model_dir(s)), {}
    p = Path(s).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file not found: {p}")
        return str(assets.gguf_model_dir(p)), {}
    if p.exists():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} is not a model folder (no config.json)")
        return str(p), {}
    return s, {}  # a Hub id: transformers resolves it (offline from its cache when HF_HUB_OFFLINE=1)


def load_target(name_or_path: str | Path = assets.DEFAULT_TARGET, dtype: torch.dtype | str = torch.float32,
                device="cpu", adapter: str | Path | None = None, merge_adapter: bool = False,
                trust_remote_code: bool = False, attn_implementation: str = "sdpa",
                revision: str | None = None, tp_size: int = 1, device_map: str | dict | None = None,
                max_memory: dict | None = None, offload_folder: str | Path | None = None,
                only_tp: bool = False, decoder: bool = True) -> Target:
    """Load a target: embedded name, local HF folder, Hub id or .gguf file, plus an optional LoRA.

    ``adapter`` is a PEFT adapter folder, kept live (``merge_adapter=False``) or merged into the weights.
    ``dtype``: a torch dtype or its name (``"bfloat16"``).
    ``tp_size`` > 1 splits the model over each group of ``tp_size`` launched processes with transformers'
    tensor-parallel plan (eaglekit.tensor_parallel; ``only_tp``: the launch must be exactly one group);
    ``device`` is then each process's own. ``device_map`` (e.g. ``"auto"``) with ``max_memory`` and
    ``offload_folder`` spreads it over devices, CPU and disk instead (accelerate's big-model placement).
    ``decoder=False`` reads only what a head borrows (embedding, final norm, lm_head; eaglekit.target.borrowed):
    enough to train from captured features, not to run the model.
    """
    path, _ = resolve(name_or_path)
    kw = {"trust_remote_code": trust_remote_code, "revision": revision}
    config = AutoConfig.from_pretrained(path, **kw)
    layout = _check_split(name_or_path, config, tp_size, device_map, adapter, only_tp)
    tokenizer = AutoTokenizer.from_pretrained(path, **kw)
    auto = auto_class(config)
    kw.update(dtype=parse_dtype(dtype), attn_implementation=attention_implementation(_model_class(config),
                                                                                      attn_implementation))
    if not decoder:
        if layout.tp_size > 1 or device_map is not None or adapter is not None:
            raise ValueError(f"{name_or_path}: decoder=False reads the borrowed modules only; it takes no tp_size, "
                             "device_map or adapter")
        model = load_without_decoder(path, config, kw["dtype"], device, kw["attn_implementation"],
                                     Target.final_norm, revision=revision, auto=auto)
        return Target(model, tokenizer, name=str(name_or_path), has_decoder=False)
    if layout.tp_size > 1:
        model = auto.from_pretrained(path, **kw, **tp.from_pretrained_kwargs(layout))
        tp.settle(model)
    elif device_map is not None:
        model = auto.from_pretrained(path, device_map=device_map, max_memory=max_memory,
                                                     offload_folder=offload_folder, **kw)
    else:
        model = auto.from_pretrained(path, **kw).to(device)
    if adapter is not None:
        from peft import PeftModel  # an optional dependency, needed only with an adapter

        model = PeftModel.from_pretrained(model, str(adapter)).to(device)
        if merge_adapter:
            model = model.merge_and_unload()
    target = Target(model, tokenizer, name=str(name_or_path)).split(layout)
    target.model_config = config  # the checkpoint's own: its architectures name what engines serve
    if device_map is not None:
        target._input_device = _first_device(model)
    return target


def _check_split(name, config, tp_size: int, device_map, adapter, only_tp: bool) -> tp.Layout:
    """The launch layout for ``tp_size``, after refusing what cannot be split so (before any weight is read)."""
    layout = tp.launch_layout(tp_size, only_tp=only_tp)
    if tp_size == 1:
        return layout
    if device_map is not None:
        raise ValueError(f"{name}: target.tp_size={tp_size} and target.device_map={device_map!r} are two ways to "
                         "split a target; give one")
    if adapter is not None:
        raise ValueError(f"{name}: an adapter with target.tp_size={tp_size} is not supported; merge it into a saved "
                         "model first (PeftModel.merge_and_unload, save_pretrained) and load that")
    tp.check_model(config, tp_size, str(name))
    return layout


def auto_class(config):
    """The transformers auto class that builds ``config``'s model: the causal LM's, else (a VL config with no
    causal-LM class) the image-text one, whose language model is tapped."""
    if type(config) in AutoModelForCausalLM._model_mapping or not hasattr(config, "text_config"):
        return AutoModelForCausalLM
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText if type(config) in AutoModelForImageTextToText._model_mapping \
        else AutoModelForCausalLM


def _model_class(config) -> type:
    """The class transformers builds for ``config`` (``object`` when it maps none, e.g. remote code)."""
    try:
        return auto_class(config)._model_mapping[type(config)]
    except KeyError:
        return object


def _first_device(model) -> torch.device:
    """Where inputs go for a model spread by a device map: the first placed module's device (a module
    offloaded to the CPU or disk runs on the CPU)."""
    for where in getattr(model, "hf_device_map", {}).values():
        if isinstance(where, int):
            return torch.device("cuda", where)
        if where not in ("cpu", "disk"):
            return torch.device(where)
    return torch.device("cpu")


def job_device(device: str | None, default: str = "cpu") -> str:
    """A job's device: ``device`` or ``default``; ``"cuda"`` under a launcher is this process's GPU."""
    device = device or default
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        return f"cuda:{os.environ['LOCAL_RANK']}"
    return device


def load_target_from(spec: TargetSpec | str, device=None, decoder: bool = True) -> Target:
    """The target a config's ``target:`` section describes (a plain name works); ``device`` (e.g. a
    trainer's accelerator device) wins over the section's, which defaults to the CPU."""
    spec = TargetSpec(name=spec) if isinstance(spec, str) else spec
    return load_target(spec.name, dtype=spec.dtype, device=device or job_device(spec.device),
                       adapter=spec.adapter, merge_adapter=spec.merge_adapter,
                       trust_remote_code=spec.trust_remote_code, revision=spec.revision, tp_size=spec.tp_size,
                       device_map=spec.device_map, max_memory=spec.max_memory, offload_folder=spec.offload_folder,
                       decoder=decoder)
