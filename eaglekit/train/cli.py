"""``eaglekit train --config X.yaml key=value``: the same run as ``accelerate launch train_head.py``."""
from __future__ import annotations

import os


def run(args) -> int:
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import train

    cfg = load_train_config(args.config, args.overrides)
    train(cfg)
    return finish()


def finish() -> int:
    """End a distributed run cleanly: gloo sometimes aborts at interpreter exit, so leave explicitly."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)
    return 0
