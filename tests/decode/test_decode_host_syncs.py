"""The decode step reads the device at most twice, whatever the tree: once for the tree's nodes (the mask
choice, the acceptance walk, the stats) and once for the verify rows' argmax; a batch reads both for all
rows at once. A read is counted as a call of Tensor.item / tolist / __bool__ / __int__ / __float__ (each
waits for the queued kernels on a GPU) made inside ``Decoder.step`` (one row or several: the same step)."""
from __future__ import annotations

import pytest
import torch
from helpers import tiny_target
from test_decode_core import tiny_head

from eaglekit import decode
from eaglekit.decode import loop
from eaglekit.decode.drafters import TreeSpec

READS = ("item", "tolist", "__bool__", "__int__", "__float__")


def reads_per_step(monkeypatch, cls) -> list[int]:
    """Patch ``cls.step`` to count the tensor reads of each call."""
    counts, step = [], cls.step

    def counted(self, *a, **k):
        n = [0]
        saved = {m: getattr(torch.Tensor, m) for m in READS}

        def wrap(fn):
            def read(t, *x, **y):
                n[0] += 1
                return fn(t, *x, **y)
            return read
        for m, fn in saved.items():
            setattr(torch.Tensor, m, wrap(fn))
        try:
            return step(self, *a, **k)
        finally:
            for m, fn in saved.items():
                setattr(torch.Tensor, m, fn)
            counts.append(n[0])
    monkeypatch.setattr(cls, "step", counted)
    return counts


@pytest.mark.parametrize("spec", [TreeSpec(4, 4, 16), TreeSpec(6, 4, 40)], ids=["16 nodes", "40 nodes"])
@pytest.mark.parametrize("rows", [1, 3])
def test_at_most_two_reads_per_step(monkeypatch, spec, rows):
    t = tiny_target()
    head = tiny_head(t, "eagle3")
    counts = reads_per_step(monkeypatch, loop.Decoder)
    prompts = [[2, 8, 9, 10], [2, 20, 21], [2, 30, 31, 32, 33]][:rows]
    ids = torch.tensor(prompts) if rows == 1 else prompts
    out = decode.generate(t, head, ids, 12, eos_token_id=False, tree=spec)
    assert max(out.stats.tree_sizes) == spec.total_tokens  # the trees were as large as asked
    assert counts and max(counts) <= 2, counts


def test_a_step_waits_for_the_device_twice(monkeypatch):
    """The step times its two laps inline (``loop.synced_clock``): two readings per step, each one
    torch.cuda.synchronize on a CUDA device (patched: no GPU needed) and none on a CPU."""
    waits = []
    monkeypatch.setattr(loop.torch.cuda, "synchronize", lambda device=None: waits.append(device))
    assert loop.synced_clock(torch.device("cuda", 0)) > 0 and waits == [torch.device("cuda", 0)]
    assert loop.synced_clock(torch.device("cpu")) > 0 and len(waits) == 1
    readings, clock = [], loop.synced_clock
    monkeypatch.setattr(loop, "synced_clock", lambda device: readings.append(device) or clock(device))
    steps = reads_per_step(monkeypatch, loop.Decoder)
    t = tiny_target()
    decode.generate(t, tiny_head(t, "eagle3"), [[2, 8, 9, 10], [2, 20, 21]], 6, eos_token_id=False,
                    tree=TreeSpec(4, 4, 16))
    assert steps and len(readings) == 2 * len(steps)
