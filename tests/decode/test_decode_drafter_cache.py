"""The drafter's static cache: a head's keys and values live in preallocated buffers written in place (rollback
moves a length, a full buffer doubles), the rows of one head share one buffer, and a decode step concatenates
nothing in the drafter's cache code (torch.cat patched and its callers recorded while steps run)."""
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_target
from test_decode_batch import PROMPTS, hf_row, new_rows
from test_decode_core import tiny_head

import eaglekit
from eaglekit import decode
from eaglekit.decode import drafters, loop
from eaglekit.decode.drafters import TreeSpec
from eaglekit.heads import layers
from eaglekit.heads.layers import HeadCache, HeadRows, RowsStep

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(eaglekit.__file__).parent


def code_of(*owners) -> set:
    """The code objects of ``owners`` (functions, and every method and property of classes)."""
    found = set()
    for owner in owners:
        members = vars(owner).values() if isinstance(owner, type) else [owner]
        for m in members:
            for f in (m.fget, m.fset) if isinstance(m, property) else (getattr(m, "__func__", m),):
                found |= {f.__code__} if hasattr(f, "__code__") else set()
    return found


# the drafter's cache code: the head caches and the catch-up that feeds them
CACHE_CODE = code_of(layers.HeadCache, layers.HeadRows, layers.RowCache, layers.RowsStep, layers._grown,
                     drafters.HeadProposer, drafters.rows_of, drafters.catch_up_rows,
                     drafters.catch_up.__wrapped__, drafters._catch_up_one, drafters._catch_up_rows)


def cats_during_steps(monkeypatch) -> list:
    """Patch torch.cat (while ``Decoder.step`` runs) to record the code object of each caller in eaglekit."""
    calls, cat, step = [], torch.cat, loop.Decoder.step
    active = []

    def counting_cat(*a, **k):
        if active:
            code = sys._getframe(1).f_code
            if code.co_filename.startswith(str(ROOT)):
                calls.append(code)
        return cat(*a, **k)

    def traced(self, *a, **k):
        active.append(1)
        try:
            return step(self, *a, **k)
        finally:
            active.pop()
    monkeypatch.setattr(torch, "cat", counting_cat)
    monkeypatch.setattr(loop.Decoder, "step", traced)
    return calls


@pytest.mark.parametrize("rows", [1, 3])
def test_decode_head_steps_concatenate_nothing_in_the_drafter_cache(monkeypatch, rows):
    t = tiny_target(vocab_size=64, layers=3)
    head = tiny_head(t, "eagle3", 48)
    prompts = PROMPTS[:rows]
    calls = cats_during_steps(monkeypatch)
    out = decode.generate(t, head, torch.tensor(prompts) if rows == 1 else prompts, 12, eos_token_id=False,
                          tree=TreeSpec(3, 3, 8))
    got = [out.sequences[0, len(prompts[0]):].tolist()] if rows == 1 else new_rows(out, 12)
    assert got == [hf_row(t, p, 12) for p in prompts]  # still the target's own greedy decoding
    assert calls, "the patched torch.cat saw no call at all during the steps (drafters.expand concatenates)"
    in_cache = [f"{c.co_filename}:{c.co_firstlineno} {c.co_name}" for c in calls if c in CACHE_CODE]
    assert in_cache == [], in_cache


def test_decode_head_cache_writes_in_place_and_doubles_when_full():
    c = HeadCache()
    k = torch.randn(2, 3, 5, 4)
    c.update(0, k, -k)
    buffer = c._current(0)[0]
    capacity = buffer.shape[2]
    assert capacity >= 2 * 5
    c.update(0, k[:, :, :2], -k[:, :, :2])
    assert c._current(0)[0].data_ptr() == buffer.data_ptr() and c.length == 7  # in place, no new tensor
    c.crop(5)
    assert c.length == 5 and c._current(0)[0].data_ptr() == buffer.data_ptr()  # rollback moves the length
    more = torch.randn(2, 3, capacity, 4)
    keys, values = c.update(0, more, -more)  # past the capacity: one new buffer, at least twice as long
    assert c._current(0)[0].shape[2] >= 2 * capacity and c.length == 5 + capacity
    torch.testing.assert_close(keys, torch.cat([k, more], 2), rtol=0, atol=0)
    torch.testing.assert_close(values, -torch.cat([k, more], 2), rtol=0, atol=0)


def test_decode_head_rows_share_one_buffer_and_free_a_row_that_leaves():
    rows = HeadRows(1)
    a, b = rows.row(), rows.row()
    ka, kb = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4)
    a.update(0, ka, ka)
    b.update(0, kb, kb)
    assert a.keys[0].data_ptr() != b.keys[0].data_ptr() and rows.buffers[0][0].shape[0] == 2
    assert torch.equal(a.keys[0], ka) and torch.equal(b.keys[0], kb) and (a.length, b.length) == (3, 5)
    del a  # the row leaves: its slot is free, and the next row takes it, empty
    assert rows.lengths[0] is None
    c = rows.row()
    assert c.slot == 0 and c.length == 0 and torch.equal(b.keys[0], kb)
    del b, c  # the last row leaves: nothing is kept alive
    assert rows.lengths == [] and rows.buffers == [None]


def test_decode_rows_step_equals_each_row_alone():
    """One forward over rows of different lengths (one empty) writes each row's entries where that row's own
    update would, and the outputs match each row run alone."""
    t = tiny_target(vocab_size=64, layers=3)
    head = tiny_head(t, "eagle3", 48)
    rows = HeadRows(head.config.num_layers)
    caches, alone = [rows.row() for _ in range(3)], [HeadCache() for _ in range(3)]
    g = torch.Generator().manual_seed(0)
    for n, shared, own in zip([4, 0, 2], caches, alone):
        if n:
            ids, feat = torch.randint(5, 64, (1, n), generator=g), torch.randn(1, n, 32, generator=g)
            head.step(ids, feat, torch.arange(n)[None], cache=shared)
            head.step(ids, feat, torch.arange(n)[None], cache=own)
    step = RowsStep(rows, 0, 3, torch.device("cpu"))
    ids, feat = torch.randint(5, 64, (3, 2), generator=g), torch.randn(3, 2, 32, generator=g)
    hidden, _ = head.step(ids, feat, step.positions(2), cache=step, attn_mask=step.mask(2, torch.float32))
    for b, (shared, own) in enumerate(zip(caches, alone)):
        step.advance(b, 2)
        h, _ = head.step(ids[b:b + 1], feat[b:b + 1], torch.arange(own.length, own.length + 2)[None], cache=own)
        torch.testing.assert_close(hidden[b:b + 1], h, atol=1e-5, rtol=1e-5)
        assert shared.length == own.length
        torch.testing.assert_close(shared.keys[0], own.keys[0], atol=1e-5, rtol=1e-5)


def test_decode_batch_keeps_nothing_alive_after_it_ends(monkeypatch):
    """While a batch decodes (a row ending early), the head's shared buffer holds a slot per row it started at
    most; once the decode returns and its drafters are dropped, it holds no slot and no buffer."""
    t = tiny_target(vocab_size=64, layers=3)
    head = tiny_head(t, "eagle3", 48)
    eos = hf_row(t, PROMPTS[0], 3)[-1]  # row 0 ends at its third token
    live, step = [], loop.Decoder.step

    def traced(self, *a, **k):
        live.append((len(self.drafters), sum(n is not None for n in drafters.rows_of(head).lengths)))
        return step(self, *a, **k)
    monkeypatch.setattr(loop.Decoder, "step", traced)
    decode.generate(t, head, PROMPTS[:3], 10, eos_token_id=eos, tree=TreeSpec(3, 3, 8))
    assert live[0] == (3, 3) and min(n for n, _ in live) < 3 and all(held <= 3 for _, held in live), live
    assert drafters.rows_of(head).lengths == [] and drafters.rows_of(head).buffers == [None] * head.config.num_layers


def test_decode_head_cache_follows_a_head_cast_to_another_dtype():
    """Keys of another dtype (the head was cast between two updates) get a buffer of that dtype, holding the
    old entries converted, not zeros."""
    c, k = HeadCache(), torch.randn(1, 2, 3, 4)
    c.update(0, k, k)
    keys, _ = c.update(0, k.double(), k.double())
    assert keys.dtype == torch.float64 and torch.equal(keys, torch.cat([k, k], 2).double())
