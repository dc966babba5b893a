"""Imported at start-up by every process the suite launches (tests/conftest.py puts this folder on PYTHONPATH).

DeepSpeed's CPU accelerator JIT-compiles a shared-memory allreduce op (~45 CPU-s on 2 cores) into
~/.cache/torch_extensions the first time a run initialises DeepSpeed, and compiles it again whenever the virtual
environment's path changes (the compiler's include paths are in its build command): once per fresh clone's
suite. The distributed tests check what ZeRO computes, which torch.distributed's gloo allreduce (what DeepSpeed
uses without the op, and what DDP uses) computes too; so here DeepSpeed is told the op is unavailable.
A user's own runs are untouched: this file is on no path but the suite's.
"""
import importlib.abc
import importlib.util
import sys


class _WithoutShmOp(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed.comm.torch":
            return None
        sys.meta_path.remove(self)  # find the real module below, once
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            module.build_shm_op = lambda: None  # what DeepSpeed itself returns where the op is incompatible

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _WithoutShmOp())
