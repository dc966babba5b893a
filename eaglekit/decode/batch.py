"""Until ``api`` calls ``loop.run`` for a batch too: ``run_batch`` is ``loop.run`` with a list of drafters."""
from __future__ import annotations

from eaglekit.decode.loop import pad_prompts, run

__all__ = ["pad_prompts", "run_batch"]


def run_batch(target, drafters: list, ids, starts: list[int], max_new_tokens: int, sampling, generator=None,
              eos=frozenset(), stop=None, pad_id: int = 0):
    return run(target, list(drafters), ids, max_new_tokens, sampling, generator, eos, stop, None, starts, pad_id)
