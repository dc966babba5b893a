"""``eaglekit export``: write a trained head in a serving engine's layout (validated key set)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from eaglekit.config import Dtype, PosInt, TargetSpec, load_config, parse_dtype
from eaglekit.export.formats import FORMATS, LLAMA_CPP, export_to
from eaglekit.export.hub import load_head_target
from eaglekit.export.layouts import EXPORT_BLOCK
from eaglekit.heads.io import read_config
from eaglekit.target import Target, load_target_from


@dataclass
class ExportOptions:
    head: str = ""  # a saved head folder (or Hub id)
    out: str = ""  # the folder to write
    to: str = "sglang"  # sglang | vllm | speculators | eagle1 | llama.cpp (a GGUF for llama-server -md) | checkpoint
    target: TargetSpec | None = None  # default: the target named in the head's config
    verifier: str = ""  # target id written for engines (ORG/NAME or a local model folder); default: derived
    dtype: Dtype | None = None  # e.g. bfloat16; default: the head's own dtype
    speculative_tokens: PosInt = 3  # speculators config: proposal length
    gguf_type: str = "f16"  # llama.cpp: the GGUF's weight type, f16 | q8_0 | bf16 | f32 (bytes per draft token)
    overwrite: bool = False


def add_arguments(p) -> None:
    p.add_argument("--head", help="saved head folder or Hub id")
    p.add_argument("--out", help="output folder")
    p.add_argument("--to", choices=list(FORMATS), help="layout to write (llama.cpp: a GGUF for llama-server -md)")
    p.add_argument("--gguf-type", help="llama.cpp: the GGUF weight type, f16 (default), q8_0, bf16 or f32")
    p.add_argument("--target", help="target model (default: the one the head was trained for)")
    p.add_argument("--verifier", help="the target's id written where engines read it: ORG/NAME or a local "
                   "model folder (default: the embedded target's Hub id, a folder's _name_or_path)")
    p.add_argument("--dtype", help="weight dtype of the export (default: the head's)")
    p.add_argument("--overwrite", action="store_true", default=None, help="write into a non-empty folder")


def options(args, cls=ExportOptions):
    """The command's config: ``--config`` file, then ``key=value`` overrides, then the ``--flags`` (each flag
    is the key of the same name: ``--repo-id X`` is ``repo_id=X``)."""
    flags = [f"{k}={json.dumps(v)}" for k, v in vars(args).items() if k in cls.__dataclass_fields__ and v is not None]
    return load_config(cls, args.config, [*args.overrides, *flags])


def load_target_for(head_dir: str, target: TargetSpec | str | None) -> Target:
    """The target to bind: ``target`` if given, else the one named in the head's config."""
    return load_target_from(target) if target else load_head_target(head_dir)


def run(args) -> int:
    opts = options(args)
    if not opts.head or not opts.out:
        raise SystemExit("eaglekit export: --head and --out are required")
    target = load_target_for(opts.head, opts.target)
    dtype = parse_dtype(opts.dtype) if opts.dtype is not None else None
    out = export_to(opts.head, opts.out, opts.to, target, dtype=dtype, overwrite=opts.overwrite,
                    speculative_tokens=opts.speculative_tokens, verifier=opts.verifier or None,
                    gguf_type=opts.gguf_type)
    if opts.to == "checkpoint":
        print(f"wrote a copy of the target's checkpoint holding the MTP head to {out} (serve it as the target: "
              "vLLM's deepseek_mtp / SGLang's NEXTN read its next-n layers)")
        return 0
    if opts.to == LLAMA_CPP:
        print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {opts.gguf_type}) with llama.cpp's converter; serve it "
              f"with: llama-server -m TARGET.gguf -md {out} --spec-type draft-eagle3 (docs/serving.md)")
        return 0
    written = read_config(out).get(EXPORT_BLOCK, {})
    print(f"wrote {opts.to} layout to {out} for {', '.join(written.get('engines', []))} "
          f"(verifier {written.get('verifier') or 'not named'}; key set, shapes, engine fields and finite "
          "weights checked)")
    return 0
