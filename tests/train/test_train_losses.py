"""The chunked teacher / soft CE equals the naive full-vocabulary computation (value and gradient)."""
import pytest
import torch

from eaglekit.heads.objectives import (
    Teacher,
    TeacherRows,
    acceptance_loss,
    projected_soft_cross_entropy,
    shift_left,
    soft_cross_entropy,
    teacher_argmax,
)


def naive_soft_cross_entropy(student, hidden, weight, row_weight) -> torch.Tensor:
    """The reference: full teacher logits materialised at once (what the chunked version avoids)."""
    p = torch.softmax((hidden.to(weight.dtype) @ weight.T).float(), dim=-1)
    logq = torch.log_softmax(student.float(), dim=-1)
    return -(row_weight[..., None].float() * p * logq).sum()


def _inputs(seed=0, B=3, S=11, H=16, V=97, Vd=40):
    g = torch.Generator().manual_seed(seed)
    last = torch.randn(B, S, H, generator=g)
    w = torch.randn(V, H, generator=g)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=g)[:Vd]] = True
    student = torch.randn(B, S, Vd, generator=g) * 3
    row_w = (torch.rand(B, S, generator=g) > 0.3).float() * torch.rand(B, S, generator=g)
    return last, w, t2d, student, row_w


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_train_chunked_soft_ce_equals_naive(chunk):
    last, w, t2d, student, row_w = _inputs()
    wd = w[t2d]
    s1 = student.clone().requires_grad_(True)
    s2 = student.clone().requires_grad_(True)
    got = soft_cross_entropy(s1, last, wd, row_w, chunk)
    ref = naive_soft_cross_entropy(s2, last, wd, row_w)
    got.backward()
    ref.backward()
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), (got, ref)
    assert torch.allclose(s1.grad, s2.grad, rtol=1e-5, atol=1e-6)
    assert s1.grad[row_w == 0].abs().max() == 0  # skipped rows get no gradient
    assert s1.grad.abs().sum() > 0


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_train_projected_soft_ce_equals_linear_then_soft_ce_by_shifted_rows(chunk):
    """Logits recomputed in backward (loss.recompute_logits) = lm_head then the soft CE; the teacher read
    by index (TeacherRows.shifted) = the shifted copy."""
    last, w, t2d, _, row_w = _inputs(seed=4)
    row_w[:, -2:] = 0  # rows whose teacher lies past the end carry no weight (the loss's valid mask)
    g = torch.Generator().manual_seed(5)
    normed, lm = torch.randn(3, 11, 16, generator=g) * 2, torch.randn(40, 16, generator=g)
    x1, w1 = normed.clone().requires_grad_(True), lm.clone().requires_grad_(True)
    x2, w2 = normed.clone().requires_grad_(True), lm.clone().requires_grad_(True)
    got, pred = projected_soft_cross_entropy(x1, w1, TeacherRows.shifted(last, 2), w[t2d], row_w, chunk)
    logits = x2 @ w2.T
    ref = naive_soft_cross_entropy(logits, shift_left(last, 2), w[t2d], row_w)
    got.backward(), ref.backward()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(pred, logits.argmax(-1))
    for a, b in ((x1.grad, x2.grad), (w1.grad, w2.grad)):  # fp32 sums in another order: 1e-6 of the largest
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * float(b.abs().max()))
    assert x1.grad[row_w == 0].abs().max() == 0 and x1.grad.abs().sum() > 0


def test_train_projected_soft_ce_under_bf16_autocast_is_close_to_the_unfused_path():
    """Under autocast (optim.bf16) the loss and gradients match lm_head-then-soft-CE at bf16 precision (the two
    differ by ~0.6% of the largest gradient entry, as either does from fp32), in the fp32 leaves' dtype."""
    last, w, t2d, _, row_w = _inputs(seed=6)
    row_w[:, -1:] = 0
    g = torch.Generator().manual_seed(7)
    normed, lm = torch.randn(3, 11, 16, generator=g), torch.randn(40, 16, generator=g)
    x1, w1 = normed.clone().requires_grad_(True), lm.clone().requires_grad_(True)
    x2, w2 = normed.clone().requires_grad_(True), lm.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = projected_soft_cross_entropy(x1, w1, TeacherRows.shifted(last, 1), w[t2d], row_w, 4)
        ref = soft_cross_entropy(torch.nn.functional.linear(x2, w2), shift_left(last, 1), w[t2d], row_w, 4)
    got.backward(), ref.backward()
    assert x1.grad.dtype == w1.grad.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    for a, b in ((x1.grad, x2.grad), (w1.grad, w2.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2 * float(b.abs().max()))


@pytest.mark.parametrize("loss", ["soft_ce", "projected", "lk"])
def test_train_hand_written_backwards_scale_with_the_upstream_gradient(loss):
    """The trainer backpropagates ``loss_sum * scale`` (scale ~ 1 / supervised positions), never the loss
    alone: each hand-written backward must multiply by its upstream gradient. Under 0.01 upstream the
    gradients are 0.01 times those under 1 (a backward that drops the factor is 100x off), and the soft CE's
    are plain autograd's through the same formula."""
    last, w, t2d, _, row_w = _inputs(seed=8)
    wd = w[t2d]
    g = torch.Generator().manual_seed(9)
    normed, lm = torch.randn(3, 11, 16, generator=g), torch.randn(40, 16, generator=g)

    def grads(upstream: float, reference: bool = False):
        x, lw = normed.clone().requires_grad_(True), lm.clone().requires_grad_(True)
        if reference:
            value = naive_soft_cross_entropy(x @ lw.T, last, wd, row_w)
        elif loss == "projected":
            value, _ = projected_soft_cross_entropy(x, lw, last, wd, row_w, 4)
        elif loss == "lk":
            value = acceptance_loss(x @ lw.T, last, wd, row_w, "lk", chunk=4)
        else:
            value = soft_cross_entropy(x @ lw.T, last, wd, row_w, 4)
        return torch.autograd.grad(value, [x, lw], grad_outputs=torch.tensor(upstream))

    small, unit = grads(0.01), grads(1.0)
    for got, base in zip(small, unit):
        assert base.abs().max() > 0
        torch.testing.assert_close(got, 0.01 * base, rtol=1e-5, atol=1e-7 * float(base.abs().max()))
    if loss != "lk":
        for got, want in zip(small, grads(0.01, reference=True)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))


def test_train_chunked_soft_ce_bf16_student_close_to_naive():
    last, w, t2d, student, row_w = _inputs(seed=1)
    s1 = student.bfloat16().requires_grad_(True)
    s2 = student.bfloat16().float().requires_grad_(True)
    got = soft_cross_entropy(s1, last.bfloat16(), w[t2d], row_w, 5)
    ref = naive_soft_cross_entropy(s2, last.bfloat16().float(), w[t2d], row_w)
    got.backward(), ref.backward()
    assert s1.grad.dtype == torch.bfloat16
    assert torch.allclose(got, ref, rtol=1e-4), (got, ref)
    assert torch.allclose(s1.grad.float(), s2.grad, atol=1e-2)


def test_train_teacher_argmax_and_draft_mapping():
    last, w, t2d, *_ = _inputs(seed=2, V=301, Vd=150)
    full = (last @ w.T).argmax(-1)
    assert torch.equal(teacher_argmax(last, w, chunk=7), full)
    t = Teacher.build(w, t2d)
    ids = t.targets(last, chunk=4)
    inside = t2d[full]
    assert inside.any() and (~inside).any()  # the test covers both cases
    assert (ids[~inside] == -1).all()
    d2t = t2d.nonzero().squeeze(1)  # draft id -> target id
    assert torch.equal(d2t[ids[inside]], full[inside])
    assert torch.equal(t.draft_weight, w[t2d])


def test_train_shift_left():
    x = torch.arange(10).view(2, 5)
    assert shift_left(x, 2, fill=-1).tolist() == [[2, 3, 4, -1, -1], [7, 8, 9, -1, -1]]
    assert shift_left(x, 7).tolist() == [[0] * 5, [0] * 5]
    assert shift_left(x, 0) is x


def test_every_loss_option_read_by_name_is_a_config_field():
    """The losses read their optional settings as ``getattr(loss, name, default)`` (unit tests hand them a
    SimpleNamespace), so a name LossConfig does not have would train with the default, silently: every such
    name is a LossConfig field."""
    import dataclasses
    import re
    from pathlib import Path

    import eaglekit
    from eaglekit.train.config import LossConfig

    sources = Path(eaglekit.__file__).parent.rglob("*.py")
    read = {name for p in sources for name in re.findall(r'getattr\(loss, "(\w+)"', p.read_text())}
    assert {"objective", "block_weighting", "dpace_alpha", "recompute_logits", "cod_ratio"} <= read
    assert read <= {f.name for f in dataclasses.fields(LossConfig)}, read - {f.name for f in dataclasses.fields(LossConfig)}
