"""``eaglekit export``: write a trained head in a serving engine's layout (validated key set)."""
from __future__ import annotations

from dataclasses import dataclass

from eaglekit.config import PosInt, load_config


@dataclass
class ExportOptions:
    head: str = ""  # a saved head folder (or Hub id)
    out: str = ""  # the folder to write
    to: str = "sglang"  # sglang | vllm | speculators | eagle1
    target: str = ""  # default: the target named in the head's config
    verifier: str = ""  # target id written for engines (ORG/NAME or a local model folder); default: derived
    dtype: str = ""  # e.g. bfloat16; default: the head's own dtype
    speculative_tokens: PosInt = 3  # speculators config: proposal length
    overwrite: bool = False


def add_arguments(p) -> None:
    p.add_argument("--head", help="saved head folder or Hub id")
    p.add_argument("--out", help="output folder")
    p.add_argument("--to", choices=["sglang", "vllm", "speculators", "eagle1"], help="layout to write")
    p.add_argument("--target", help="target model (default: the one the head was trained for)")
    p.add_argument("--verifier", help="the target's id written where engines read it: ORG/NAME or a local "
                   "model folder (default: the embedded target's Hub id, a folder's _name_or_path)")
    p.add_argument("--dtype", help="weight dtype of the export (default: the head's)")
    p.add_argument("--overwrite", action="store_true", default=None, help="write into a non-empty folder")


def options(args, cls=ExportOptions):
    flags = {k: v for k, v in vars(args).items() if k in cls.__dataclass_fields__ and v is not None}
    opts = load_config(cls, args.config, args.overrides)
    for k, v in flags.items():
        setattr(opts, k, v)
    return opts


def load_target_for(head_dir: str, target: str):
    """The target to bind: ``target`` if given, else the name stored in the head's config."""
    from eaglekit.heads.io import read_config, resolve_dir
    from eaglekit.target import load_target

    if not target:
        cfg = read_config(resolve_dir(head_dir))
        target = (cfg.get("eaglekit") or cfg).get("target_name", "")
        if not target:
            raise SystemExit(f"{head_dir}: the head names no target; pass --target")
    return load_target(target)


def run(args) -> int:
    import torch

    from eaglekit.heads.export import EXPORT_BLOCK, export_to
    from eaglekit.heads.io import read_config

    opts = options(args)
    if not opts.head or not opts.out:
        raise SystemExit("eaglekit export: --head and --out are required")
    target = load_target_for(opts.head, opts.target)
    dtype = getattr(torch, opts.dtype) if opts.dtype else None
    out = export_to(opts.head, opts.out, opts.to, target, dtype=dtype, overwrite=opts.overwrite,
                    speculative_tokens=opts.speculative_tokens, verifier=opts.verifier or None)
    written = read_config(out).get(EXPORT_BLOCK, {})
    print(f"wrote {opts.to} layout to {out} for {', '.join(written.get('engines', []))} "
          f"(verifier {written.get('verifier') or 'not named'}; key set, shapes, engine fields and finite "
          "weights checked)")
    return 0
