"""Gradient accumulation takes the same step as one big batch: the gradient summed over micro-batches equals
the full batch's gradient (train/trainer.py's loss normalisation: supervised positions of the whole global
batch). A tiny model, in process, seconds; the 2-process check of the same rule is in test_train_distributed."""
import pytest
import torch
from helpers import save_tiny, tiny_conversations

from eaglekit.train.config import load_train_config
from eaglekit.train.trainer import build_trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: one thread, see conftest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("accum")
    save_tiny(d / "tiny", vocab_size=64, hidden=32, layers=4)
    tiny_conversations(d / "convs.jsonl", n=16)
    return d


def _trainer(d, out, batch_size: int, grad_accum: int, *extra: str):
    # grad_clip far above any norm here: the captured gradient is the loss's own, not a clipped one
    return build_trainer(load_train_config(None, [
        f"target={d / 'tiny'}", f"data.conversations={d / 'convs.jsonl'}", "data.eval_samples=2",
        "head.kind=eagle3", "head.draft_vocab_size=32", "loss.ttt_steps=2", f"data.batch_size={batch_size}",
        f"optim.grad_accum={grad_accum}", "optim.grad_clip=1e9", "optim.lr=1e-3", "progress=false",
        "trackers=[]", "eval_interval=0", "save_interval=0", f"output_dir={out}", *extra]))


def _step_gradients(trainer, micro_batches) -> tuple[dict, dict]:
    """(train_step's record, the head's gradients at the moment the optimizer steps)."""
    grads, step = {}, trainer.opt.step

    def capture(*args, **kw):
        if trainer.acc.sync_gradients:  # Accelerate's optimizer only steps on the last micro-batch
            grads.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
                          if p.grad is not None})
        return step(*args, **kw)

    trainer.opt.step = capture
    try:
        return trainer.train_step(micro_batches), grads
    finally:
        trainer.opt.step = step
        trainer.lock.release()


def test_accumulated_micro_batches_give_the_full_batch_gradient(tiny, tmp_path):
    full = _trainer(tiny, tmp_path / "full", batch_size=3, grad_accum=1)
    lengths = full.src.train.lengths
    # three samples of different lengths: a per-micro-batch mean, or a lost 1/grad_accum, weighs them wrongly
    picked = sorted(range(len(lengths)), key=lambda i: lengths[i])[::max(1, len(lengths) // 3)][:3]
    assert len({lengths[i] for i in picked}) == 3, [lengths[i] for i in picked]
    rec_full, g_full = _step_gradients(full, [picked])
    accum = _trainer(tiny, tmp_path / "accum", batch_size=1, grad_accum=3)
    rec_acc, g_acc = _step_gradients(accum, [[i] for i in picked])
    assert rec_full["supervised"] == rec_acc["supervised"] > 0
    assert rec_acc["loss"] == pytest.approx(rec_full["loss"], rel=1e-5)
    assert g_full.keys() == g_acc.keys() and len(g_full) > 0
    for name in g_full:
        scale = float(g_full[name].abs().max())
        assert scale > 0, name  # every trained parameter got a gradient: the comparison is not vacuous
        torch.testing.assert_close(g_acc[name], g_full[name], rtol=1e-4, atol=1e-6 * scale, msg=name)
    assert rec_acc["grad_norm"] == pytest.approx(rec_full["grad_norm"], rel=1e-4)


def test_recomputed_logits_take_the_same_trainer_step(tiny, tmp_path):
    """loss.recompute_logits on and off: the same gradients at the optimizer step (the trainer scales the loss
    by 1 / supervised positions, so a backward that ignores its upstream gradient is off by that count) and
    the same weights after it (Adam would hide a uniform scale in the step itself: the gradients are compared)."""
    runs = {}
    for fused in (False, True):
        trainer = _trainer(tiny, tmp_path / f"fused-{fused}", 2, 1, f"loss.recompute_logits={str(fused).lower()}")
        assert trainer.cfg.loss.recompute_logits is fused
        record, grads = _step_gradients(trainer, [[0, 1]])
        runs[fused] = record, grads, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    (rec_off, g_off, w_off), (rec_on, g_on, w_on) = runs[False], runs[True]
    assert rec_on["supervised"] == rec_off["supervised"] > 1
    assert rec_on["loss"] == pytest.approx(rec_off["loss"], rel=1e-5)
    assert rec_on["grad_norm"] == pytest.approx(rec_off["grad_norm"], rel=1e-4)
    assert g_on.keys() == g_off.keys() and any("lm_head" in n for n in g_on)
    for name in g_off:
        scale = float(g_off[name].abs().max())
        assert scale > 0, name
        torch.testing.assert_close(g_on[name], g_off[name], rtol=1e-4, atol=1e-5 * scale, msg=name)
    for name in w_off:
        torch.testing.assert_close(w_on[name], w_off[name], rtol=1e-5, atol=1e-6, msg=name)
