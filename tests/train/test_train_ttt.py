"""Training-time test unrolls exactly what chain drafting does at decode time, and its loss masks the
right positions."""
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_target

from eaglekit.heads import HeadCache, HeadConfig, build_head
from eaglekit.heads.objectives import Teacher, shift_left, ttt_loss, ttt_unroll
from eaglekit.train.config import LossConfig
from eaglekit.train.metrics import Tally

LOSS = LossConfig(ttt_steps=3, step_decay=0.8, chunk_tokens=5, cache_teacher_mb=0.0)


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(vocab_size=64, hidden=32, layers=6)
    head = build_head(HeadConfig.from_target(target, kind="eagle3", draft_vocab_size=64), target)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # break symmetric init so every step matters
    ids = torch.randint(7, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    out = target.features(ids, layer_ids=head.taps)
    return target, head, ids, out


@torch.no_grad()
def test_train_ttt_unroll_equals_sequential_chain_drafting(setup):
    _, head, ids, out = setup
    g0 = head.fuse(out.taps)
    steps = 3
    unrolled = {k: h for k, h, _ in ttt_unroll(head, ids, g0, steps)}
    S = ids.shape[1]
    for b in range(2):
        for t in (0, 4, S - 5):  # prefix ending at element t, then draft a chain of depth steps-1
            cache = HeadCache()
            x = shift_left(ids, 1)[b:b + 1, :t + 1]
            h, _ = head.step(x, g0[b:b + 1, :t + 1], torch.arange(t + 1)[None], cache=cache)
            assert torch.allclose(h[0, t], unrolled[0][b, t], atol=1e-5)
            g = h[:, t:t + 1]
            for k in range(1, steps):
                tok = ids[b:b + 1, t + 1 + k:t + 2 + k]  # the accepted (ground-truth) token x_{t+1+k}
                g, _ = head.step(tok, g, torch.tensor([[t + k]]), cache=cache)
                assert torch.allclose(g[0, 0], unrolled[k][b, t], atol=1e-5), (b, t, k)


def test_train_ttt_loss_masks_supervision_and_draft_vocab(setup):
    target, head, ids, out = setup
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, 6:] = 1
    loss_mask[1, 3:9] = 1
    batch = {"input_ids": ids, "loss_mask": loss_mask, "taps": out.taps, "last": out.last}
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    _, stats = ttt_loss(head, teacher, batch, LOSS)
    # step k counts element t when loss_mask[t + 2 + k] == 1
    assert stats.total == [int(shift_left(loss_mask, 2 + k).sum()) for k in range(3)] == [12, 12, 11]
    # a draft vocabulary that excludes every teacher argmax leaves nothing to learn from: zero loss
    top = (out.last @ target.lm_head.weight.T).argmax(-1)
    t2d = torch.ones(64, dtype=torch.bool)
    t2d[top.unique()] = False
    small = Teacher.build(target.lm_head.weight, t2d)
    vd = int(t2d.sum())
    h2 = build_head(HeadConfig.from_target(target, kind="eagle3", draft_vocab_size=vd), target)
    h2.set_draft_vocab(t2d.nonzero().squeeze(1) - torch.arange(vd), t2d)
    loss, stats = ttt_loss(h2, small, batch, LOSS, steps=2)
    assert float(loss) == 0.0 and stats.correct == [0, 0] and stats.total[0] > 0


def test_train_cached_teacher_equals_recomputed(setup):
    target, head, ids, out = setup
    loss_mask = torch.ones_like(ids)
    batch = {"input_ids": ids, "loss_mask": loss_mask, "taps": out.taps, "last": out.last}
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    results = []
    for mb in (0.0, 100.0):
        head.zero_grad()
        loss, _ = ttt_loss(head, teacher, batch, LossConfig(ttt_steps=3, step_decay=0.8, chunk_tokens=7,
                                                            cache_teacher_mb=mb))
        loss.backward()
        results.append((loss.detach(), head.fc.weight.grad.clone()))
    (l0, g0), (l1, g1) = results
    assert torch.allclose(l0, l1, rtol=1e-5) and torch.allclose(g0, g1, rtol=1e-4, atol=1e-7)
    assert g0.abs().sum() > 0


@torch.no_grad()
def test_train_chain_counts_positions_whose_steps_are_all_right(setup):
    """stats.chain[k] = supervised positions where steps 0..k all predicted the teacher argmax, counted by hand."""
    target, head, ids, out = setup
    loss_mask = torch.ones_like(ids)
    loss_mask[1, :4] = 0
    batch = {"input_ids": ids, "loss_mask": loss_mask, "taps": out.taps, "last": out.last}
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    _, stats = ttt_loss(head, teacher, batch, LOSS)
    top = teacher.targets(out.last, 5)
    preds = [logits.argmax(-1) for _, _, logits in ttt_unroll(head, ids, head.fuse(out.taps), 3)]
    B, S = ids.shape
    want = []
    for k in range(3):
        n = 0
        for b in range(B):
            for t in range(S):
                valid = t + 2 + k < S and loss_mask[b, t + 2 + k] == 1
                ok = all(t + 1 + j < S and preds[j][b, t] == top[b, t + 1 + j] for j in range(k + 1))
                n += int(valid and ok)
        want.append(n)
    assert stats.chain == want
    assert all(c <= r for c, r in zip(stats.chain, stats.correct)) and stats.chain[0] == stats.correct[0]


def test_train_tau_chain_and_tau_sim_from_a_tally():
    t = Tally(loss=[1.0, 1.0], correct=[5.0, 4.0], total=[10.0, 8.0], chain=[5.0, 3.0])
    s = Tally.from_list(t.as_list()).summary("eval_")
    assert s["eval_tau_sim"] == pytest.approx(1 + 0.5 + 0.5 * 0.5)
    assert s["eval_tau_chain"] == pytest.approx(1 + 0.5 + 3 / 8)
    old = Tally([0.0] * 2, [0.0] * 2, [0.0] * 2)  # the trainer's empty-rank tally has no chain counts
    assert Tally.from_list(old.as_list()).chain == [0.0, 0.0]
    assert "eval_candidate_recall" not in s  # only a head with a candidate selector reports it
    # DFlash 2: its block's depths are counted (here 1 of 2, as the trainer's steps may run past the block)
    t.add(SimpleNamespace(loss=[0.0, 0.0], correct=[0, 0], total=[10, 2], chain=[0, 0], recalled=[15]))
    back = Tally.from_list(t.as_list())
    assert back.recalled == [15.0, 0.0] and back.summary("eval_", recall_depths=1)["eval_candidate_recall"] == 0.75
