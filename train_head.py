"""Train an EAGLE draft head: ``accelerate launch train_head.py --config configs/X.yaml key=value ...``.

Runs as one process too (``python train_head.py --config ...``). Accelerate configs for DDP and
DeepSpeed ZeRO-2/3 live in ``configs/accelerate/``; see the README's "Training" section.
"""
from __future__ import annotations

import argparse
import sys

from eaglekit.cli import run_with_errors
from eaglekit.train.cli import run  # light: the trainer (torch) is imported once the run starts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="YAML run config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides, e.g. optim.lr=1e-4")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(run_with_errors(main))  # an error is one line, ``eaglekit: error: ...`` (EAGLEKIT_DEBUG=1: traceback)
