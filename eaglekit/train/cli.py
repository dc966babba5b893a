"""``eaglekit train --config X.yaml key=value``: the same run as ``accelerate launch train_head.py``
(``eval_only=true``: score ``head.init_from`` instead, ``evaluate.evaluate_only``)."""
from __future__ import annotations

import os
import sys

from eaglekit.cli import EXIT_ERROR, error_line
from eaglekit.train.processes import TrainError, exit_with_launcher


def run(args) -> int:
    exit_with_launcher()  # first thing: a launcher killed while this worker still imports takes it along
    # imported only now, after the line above: torch, accelerate and the model code take seconds to import
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import train

    cfg = load_train_config(args.config, args.overrides)
    try:
        train(cfg)
    except TrainError as e:  # a deliberate stop: one line from one rank, every rank leaves the group cleanly
        if not e.quiet:
            print(error_line(e), file=sys.stderr, flush=True)
        return finish(EXIT_ERROR)
    return finish()


def finish(code: int = 0) -> int:
    """End a distributed run cleanly: gloo sometimes aborts at interpreter exit, so leave explicitly.
    Every rank gets here together (a TrainError is raised on all ranks at the same point)."""
    import torch.distributed as dist  # already imported by the run; kept out of this module's import for the above

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
