"""An MTP head written back into the target's own checkpoint (``eaglekit export --to checkpoint``): a copy of the
target's folder whose next-n layers are the head's, in the layout the target ships them (DeepSeek-V3, GLM-4.5:
``model.layers.{L+k}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head, embed_tokens}`` and the block's
tensors, MoE experts one tensor each), which vLLM's ``deepseek_mtp`` / ``glm4_moe_mtp``, SGLang's NEXTN and
transformers' ``MtpModel`` read; Qwen3.5 / Qwen3-Next: ``mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden,
layers.0.*, norm}``, which vLLM's ``qwen3_5_mtp`` / ``qwen3_next_mtp`` read.

The block's tensors go back through the target's own weight conversions reversed (transformers'
``revert_weight_conversion``: fused experts split as the checkpoint stores them). The target's files are linked
into the copy (copied across filesystems); a shard that held the old next-n layers is rewritten without them; the
head's layers go to ``mtp.safetensors``, and ``model.safetensors.index.json`` maps every tensor to its file (a lone
``model.safetensors`` is renamed as a shard: loaders read that file alone when it is there).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from transformers.core_model_loading import revert_weight_conversion

from eaglekit.fileio import write_json, write_safetensors
from eaglekit.heads.config import MTP
from eaglekit.heads.mtp import layout, renames

MTP_FILE = "mtp.safetensors"
INDEX = "model.safetensors.index.json"


def shipped_tensors(head, target, dtype=None) -> dict[str, torch.Tensor]:
    """The head's MTP layers under the names and in the layout the target's checkpoint ships them (``renames``
    backwards; the block through the target's own weight conversions reversed: experts one tensor each)."""
    pairs = renames(head.config, target.num_layers)
    out, block = {}, {}
    for name, value in head.layers.state_dict().items():
        theirs, ours = next((t, o) for t, o in pairs if name.startswith(o))
        (block if ".mtp_block." in ours else out)[theirs + name[len(ours):]] = value
    out.update(revert_weight_conversion(target.model, block))
    if layout(head.config) == "nextn":
        # DeepSeek ships the embedding and the lm_head again beside each next-n layer (the engines take the
        # target's; a checkpoint that lacks them is not what they read)
        for k in range(head.config.num_layers):  # each layer its own copy (safetensors stores no shared memory)
            copy = (lambda w: w) if k == 0 else torch.clone
            out[f"model.layers.{target.num_layers + k}.shared_head.head.weight"] = copy(target.lm_head.weight)
            out[f"model.layers.{target.num_layers + k}.embed_tokens.weight"] = copy(target.embed_tokens.weight)
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
            for k, v in out.items()}


def write_checkpoint(head, target, out_dir, source=None, dtype=None, overwrite: bool = False) -> Path:
    """A copy of the target's checkpoint folder (``source``, default where its model was loaded from) holding
    ``head``'s MTP layers as its next-n layers; the config names as many (``num_nextn_predict_layers``)."""
    if head.config.kind != MTP:
        raise ValueError(f"the checkpoint layout holds MTP heads (the target's own next-n layers); this is a "
                         f"{head.config.kind} head")
    src = Path(source or target.model.config.name_or_path or "")
    if not (src / "config.json").is_file():
        raise ValueError(f"{src}: no checkpoint folder to copy (pass the target's folder)")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty (overwrite=True to write into it)")
    out.mkdir(parents=True, exist_ok=True)
    L, n, kind = target.num_layers, head.config.num_layers, layout(head.config)
    old = re.compile(r"^model\.layers\.(\d+)\.")

    def is_mtp(key):  # the target's own MTP layers (mtp.*, next-n layers past the decoder): replaced
        m = old.match(key)
        return key.startswith("mtp.") if kind != "nextn" else m is not None and int(m.group(1)) >= L

    index = {}
    for f in sorted(src.glob("*.safetensors")):
        # a lone model.safetensors is renamed: beside it, loaders would read it alone and never the index
        name = "model-00001-of-00001.safetensors" if f.name == "model.safetensors" else f.name
        with safe_open(f, "pt") as r:
            keys, meta = list(r.keys()), r.metadata()
            if any(map(is_mtp, keys)):
                write_safetensors(out / name, {k: r.get_tensor(k) for k in keys if not is_mtp(k)}, meta)
            else:
                _link(f, out / name)
        index.update({k: name for k in keys if not is_mtp(k)})
    dtype = dtype or target.dtype
    tensors = shipped_tensors(head, target, dtype)
    write_safetensors(out / MTP_FILE, tensors, {"format": "pt"})
    index.update(dict.fromkeys(tensors, MTP_FILE))
    write_json(out / INDEX, {"metadata": {}, "weight_map": dict(sorted(index.items()))})
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (INDEX, "config.json"):
            _link(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    text = config.get("text_config", config)  # a VL checkpoint keeps it with its language model's
    text["mtp_num_hidden_layers" if kind == "qwen" else "num_nextn_predict_layers"] = n
    write_json(out / "config.json", config)
    return out


def _link(src: Path, dst: Path) -> None:
    """``dst`` as a hard link to ``src`` (a checkpoint's shards are large), a copy across filesystems."""
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
