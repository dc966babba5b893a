"""DFlash's block objective (``DFlashHead.training_loss``) against a naive anchor-by-anchor reference (value,
gradient, per-depth stats), its anchor sampling (reproducible, per sequence, moving between epochs), and a
few trainer steps on a tiny target raising held-out τ_sim over the same head untrained."""
import math
from types import SimpleNamespace

import pytest
import torch
from dflash_reference import naive_block_loss
from helpers import padded_feature_batch, save_tiny, tiny_conversations, tiny_target

from eaglekit.export import load_head
from eaglekit.heads import HeadConfig, build_head
from eaglekit.heads.dflash import decay_gamma, position_weights
from eaglekit.heads.objectives import Teacher, supervised_count

pytestmark = pytest.mark.usefixtures("one_thread")
V, VD = 64, 40


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=4, vocab_size=V)


def _head(target, block=4, layers=2, seed=0):
    torch.manual_seed(seed)
    head = build_head(HeadConfig.from_target(target, kind="dflash", num_layers=layers, block_size=block,
                                             draft_vocab_size=VD), target)
    keep = torch.randperm(V)[:VD].sort().values  # some teacher argmaxes fall outside the draft vocabulary
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    head.set_draft_vocab(keep - torch.arange(VD), t2d)
    return head


def _loss(anchors=512, gamma=0.0, cache_mb=64.0):
    return SimpleNamespace(anchors=anchors, block_gamma=gamma, chunk_tokens=7, cache_teacher_mb=cache_mb,
                           topk=0, topk_weight=0.0, objective="kl")


def test_dflash_position_weights_are_the_papers_decay():
    assert decay_gamma(16) == 7.0 and decay_gamma(10) == 5.0 and decay_gamma(8) == 4.0 and decay_gamma(8, 2.5) == 2.5
    torch.testing.assert_close(position_weights(3, 4.0), torch.tensor([1.0, 0.7788008, 0.6065307]))


@pytest.mark.parametrize("cache_mb", [64.0, 0.0])  # the teacher cached per batch, or recomputed chunk by chunk
def test_dflash_objective_matches_naive_reference_value_gradient_and_stats(target, cache_mb):
    head = _head(target)
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    batch = padded_feature_batch(target)
    settings = _loss(anchors=7, gamma=2.0, cache_mb=cache_mb)  # row 0 has 11 candidates: 7 drawn, scaled 11/7
    loss, stats = head.training_loss(teacher, batch, settings, steps=3, train=False)
    anchors, keep, scale = head.sample_anchors(batch, 7, train=False)
    assert keep.sum(1).tolist() == [7, 6] and scale.tolist() == pytest.approx([11 / 7, 1.0])
    params = [head.fc.weight, head.hidden_norm.weight, head.layers[0].self_attn.k_norm.weight,
              head.layers[1].self_attn.q_proj.weight, head.layers[1].mlp.down_proj.weight, head.norm.weight]
    grads = torch.autograd.grad(loss, params)
    want, counts = naive_block_loss(head, teacher, batch, anchors, keep, scale, gamma=2.0)
    want_grads = torch.autograd.grad(want, params)
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)
    for p, a, b in zip(params, grads, want_grads):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    assert [[c, t, ch] for c, t, ch in zip(stats.correct, stats.total, stats.chain)] == counts
    assert sum(stats.loss) == pytest.approx(float(loss.detach()), rel=1e-5)


def test_dflash_objective_takes_every_candidate_and_normalises_per_anchor(target):
    """With anchors >= candidates every supervised position anchors a block (scale 1), so loss_sum over the
    trainer's supervised count is the mean block loss per anchor; depths past the block are misses."""
    head = _head(target, block=3)
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    batch = padded_feature_batch(target)
    anchors, keep, scale = head.sample_anchors(batch, 512, train=True)
    assert int(keep.sum()) == supervised_count(batch["loss_mask"]) and scale.tolist() == [1.0, 1.0]
    loss, stats = head.training_loss(teacher, batch, _loss(), steps=4)
    want, _ = naive_block_loss(head, teacher, batch, anchors, keep, scale, gamma=decay_gamma(3))
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)
    assert len(stats.total) == 4 and stats.correct[2:] == [0, 0] and stats.total[2] > 0
    assert stats.total[0] == supervised_count(batch["loss_mask"])


def test_dflash_loss_of_a_batch_is_the_sum_of_its_rows(target):
    """A row's blocks, anchors and padding-free context do not depend on its batch, so the loss over a batch
    is the sum over any split of it: gradient accumulation and DDP take the step one big batch takes."""
    head = _head(target)
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    whole = padded_feature_batch(target, lengths=(14, 9, 30, 12), seed=6)
    settings = _loss(anchors=8)
    total, stats = head.training_loss(teacher, whole, settings, steps=3, train=False)
    parts = []
    for rows in ([0, 1], [2, 3]):
        S = max((14, 9, 30, 12)[r] for r in rows)  # each micro-batch padded to its own longest row
        part = {k: v[rows][:, :S] for k, v in whole.items()}
        parts.append(head.training_loss(teacher, part, settings, steps=3, train=False))
    torch.testing.assert_close(total, parts[0][0] + parts[1][0], rtol=1e-5, atol=1e-5)
    assert stats.total == [a + b for a, b in zip(parts[0][1].total, parts[1][1].total)]
    assert stats.chain == [a + b for a, b in zip(parts[0][1].chain, parts[1][1].chain)]


def test_dflash_mask_embedding_starts_as_the_mask_row_and_is_trained(target):
    """head.mask_embedding: while the vector equals the embedding row of mask_token_id the head's loss is the
    plain head's; the vector gets a gradient (it is every mask slot's input), and moved, the loss moves."""
    plain = _head(target)
    torch.manual_seed(0)
    masked = build_head(HeadConfig.from_target(target, kind="dflash", num_layers=2, block_size=4,
                                               draft_vocab_size=VD, mask_embedding=True), target)
    masked.load_state_dict({**plain.state_dict(), "mask_embedding": masked.mask_embedding.detach().clone()})
    teacher = Teacher.build(target.lm_head.weight, plain.t2d)
    batch = padded_feature_batch(target)
    want, _ = plain.training_loss(teacher, batch, _loss(anchors=7), steps=3, train=False)
    got, _ = masked.training_loss(teacher, batch, _loss(anchors=7), steps=3, train=False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    (grad,) = torch.autograd.grad(got, [masked.mask_embedding])
    assert grad.abs().max() > 0
    with torch.no_grad():  # a short step down its gradient (the tiny target's mask row, its pad row, is 0)
        masked.mask_embedding.sub_(0.01 * grad / grad.norm())
        assert float(masked.training_loss(teacher, batch, _loss(anchors=7), steps=3, train=False)[0]) < float(got)


def test_dflash_anchor_sampling_is_reproducible_and_moves_between_epochs(target):
    batch = padded_feature_batch(target, lengths=(30, 30), seed=4)
    a, b = _head(target), _head(target)
    first = a.sample_anchors(batch, 6, train=True)[0]
    assert torch.equal(first, b.sample_anchors(batch, 6, train=True)[0])  # a fresh head draws the same
    second = a.sample_anchors(batch, 6, train=True)[0]
    assert not torch.equal(first, second)  # the next epoch's draw differs
    held = [a.sample_anchors(batch, 6, train=False)[0] for _ in range(2)]
    assert torch.equal(*held)  # evaluation always draws the same
    swapped = {k: v.flip(0) for k, v in batch.items()}  # a row's anchors do not depend on its batch slot
    assert torch.equal(b.sample_anchors(swapped, 6, train=False)[0].flip(0), held[0])
    assert bool((first[:, 1:] > first[:, :-1]).all())  # distinct, in order


def test_dflash_trained_a_few_steps_beats_untrained_on_held_out_tau(tmp_path):
    """Through the trainer (online features from a tiny target): held-out τ_sim after training > untrained."""
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import train

    save_tiny(tmp_path / "tiny", vocab_size=64, hidden=32, layers=4)
    tiny_conversations(tmp_path / "convs.jsonl", n=40)

    def run(name, *extra):
        return train(load_train_config(None, [
            f"target={tmp_path / 'tiny'}", f"data.conversations={tmp_path / 'convs.jsonl'}", "data.eval_samples=6",
            "head.kind=dflash", "head.block_size=4", "head.num_layers=1", "head.draft_vocab_size=64",
            "loss.ttt_steps=3", "data.batch_size=4", "progress=false", "trackers=[]", "eval_interval=0",
            "save_interval=0", f"output_dir={tmp_path / name}", *extra]))

    untrained = run("untrained", "optim.lr=0", "optim.max_steps=1")
    trained = run("trained", "optim.lr=5e-3", "optim.epochs=15")
    assert trained["step"] > untrained["step"]
    assert trained["eval_tau_sim"] > untrained["eval_tau_sim"] + 0.1, (trained, untrained)
    assert trained["eval_acc_0"] > untrained["eval_acc_0"]


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash-mask"])
def test_dflash_trains_offline_on_an_eagle3_capture(tmp_path, kind):
    """DFlash (and DSpark, its backbone) read the same default taps as EAGLE-3, so one capture (made for
    eagle3) trains either kind through the trainer, and the saved head loads back as its kind."""
    from eaglekit.data_prep import capture_features, read_conversations, tokenize_conversations
    from eaglekit.target import load_target
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import train

    save_tiny(tmp_path / "tiny", vocab_size=64, hidden=32, layers=4)
    tiny = load_target(tmp_path / "tiny")
    convs = read_conversations(tiny_conversations(tmp_path / "c.jsonl", n=12))
    samples, _ = tokenize_conversations(tiny.tokenizer, convs, 64)
    capture_features(tiny, samples, tmp_path / "feats", kind="eagle3", progress=False)
    final = train(load_train_config(None, [
        f"target={tmp_path / 'tiny'}", f"data.features_dir={tmp_path / 'feats'}", "data.eval_samples=3",
        f"head.kind={kind.removesuffix('-mask')}", "head.block_size=3", "head.draft_vocab_size=64", "loss.ttt_steps=2",
        "data.batch_size=3", *(["head.markov_rank=8", "loss.confidence_weight=0.5"] if kind == "dspark" else []),
        *(["head.mask_embedding=true", "optim.lr=1e-2"] if kind.endswith("-mask") else []),
        "optim.max_steps=3", "progress=false", "trackers=[]", "eval_interval=0", "save_interval=0",
        f"output_dir={tmp_path / 'out'}"]))
    assert final["step"] == 3 and {"eval_acc_0", "eval_acc_1", "eval_tau_sim"} <= set(final)
    head = load_head(tmp_path / "out" / "final", tiny)
    assert head.config.kind == kind.removesuffix("-mask") and head.config.block_size == 3
    assert head.taps == tuple(tiny.default_taps) and head.config.markov_rank == (8 if kind == "dspark" else 0)
    assert head.config.mask_embedding == kind.endswith("-mask")
    if head.config.mask_embedding:  # trained away from the row it started as, and saved
        assert not torch.allclose(head.mask_embedding, tiny.embed_tokens.weight[head.config.mask_token_id])


def test_dflash_shipped_config_loads():
    from pathlib import Path

    from eaglekit.train.config import load_train_config

    cfg = load_train_config(Path(__file__).resolve().parents[2] / "configs" / "smollm2-135m-dflash.yaml")
    assert (cfg.head.kind, cfg.head.block_size, cfg.head.num_layers, cfg.loss.anchors) == ("dflash", 8, 2, 64)
    assert cfg.loss.ttt_steps == cfg.head.block_size - 1  # the held-out stats report every block depth


def test_dflash_normalised_position_weights_divide_by_their_sum(target):
    head = _head(target)
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    batch = padded_feature_batch(target)
    plain, _ = head.training_loss(teacher, batch, _loss(gamma=2.0), steps=3, train=False)
    settings = _loss(gamma=2.0)
    settings.block_weights_normalized = True
    normed, _ = head.training_loss(teacher, batch, settings, steps=3, train=False)
    torch.testing.assert_close(normed * position_weights(head.draft_depths, 2.0).sum(), plain)


@pytest.mark.parametrize("cache_mb", [64.0, 0.0])  # the teacher cached per batch, or recomputed chunk by chunk
def test_dflash_dpace_objective_matches_naive_per_depth_reference(target, cache_mb, monkeypatch):
    """loss.block_weighting=dpace in training: each anchor's per-depth weights, the loss and its gradient
    against the anchor-by-anchor reference whose weights come from each depth's own CE against the teacher
    at t+k (naive_dpace_weights). An untrained head's near-uniform logits make every CE ~log Vd, which would
    hide a teacher read at the wrong position in the loss: its norm is scaled so the CEs differ by depth."""
    from eaglekit.heads import dflash

    head = _head(target, block=5)
    with torch.no_grad():
        head.norm.weight.mul_(10.0)
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    batch = padded_feature_batch(target)
    batch["last"] = batch["last"] * 4.0  # a peakier teacher, for the same reason
    settings = _loss(anchors=7, cache_mb=cache_mb)
    settings.block_weighting, settings.dpace_alpha = "dpace", 0.2
    seen = []

    def spy(*args, **kw):
        seen.append(dflash_dpace_weights(*args, **kw))
        return seen[-1]

    dflash_dpace_weights = dflash.dpace_weights
    monkeypatch.setattr(dflash, "dpace_weights", spy)
    loss, _ = head.training_loss(teacher, batch, settings, steps=4, train=False)
    anchors, keep, scale = head.sample_anchors(batch, 7, train=False)
    weights = {}
    want, _ = naive_block_loss(head, teacher, batch, anchors, keep, scale, gamma=1.0, dpace_alpha=0.2,
                               weights_out=weights)
    (got_w,) = seen
    assert len(weights) > 20 and int((got_w > 0).sum()) == len(weights)
    torch.testing.assert_close(torch.tensor([float(got_w[b, n, k - 1]) for b, n, k in weights]),
                               torch.tensor(list(weights.values())), rtol=1e-5, atol=1e-7)
    params = [head.fc.weight, head.layers[1].self_attn.q_proj.weight, head.norm.weight]
    grads, want_grads = torch.autograd.grad(loss, params), torch.autograd.grad(want, params)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, want_grads):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5 * float(b.abs().max()))


def test_dflash_dpace_weights_are_the_expected_length_each_depth_carries(target):
    """D-PACE: s_k = (1 - a) exp(-CE_k) + a on trained depths (1 elsewhere), w_k = sum_{j>=k} prod_{i<=j} s_i
    over trained depths — checked element by element; training with it changes the loss, stays finite."""
    from eaglekit.heads.dflash import dpace_weights

    torch.manual_seed(0)
    logits, p = torch.randn(2, 3, 4, 9), torch.softmax(torch.randn(2, 3, 4, 9), -1)
    live = (torch.rand(2, 3, 4) > 0.3).float()
    w = dpace_weights(logits, p, None, live, 0.4)
    ce = -(p * torch.log_softmax(logits, -1)).sum(-1)
    for b in range(2):
        for n in range(3):
            s = [(0.6 * math.exp(-float(ce[b, n, k])) + 0.4) if live[b, n, k] else 1.0 for k in range(4)]
            pre = [math.prod(s[:j + 1]) * float(live[b, n, j]) for j in range(4)]
            want = [sum(pre[k:]) * float(live[b, n, k]) for k in range(4)]
            torch.testing.assert_close(w[b, n], torch.tensor(want), rtol=1e-5, atol=1e-6)
    head = _head(target)
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    batch = padded_feature_batch(target)
    decay, _ = head.training_loss(teacher, batch, _loss(gamma=2.0), steps=3, train=False)
    settings = _loss(gamma=2.0)
    settings.block_weighting, settings.dpace_alpha = "dpace", 0.5
    dpace, _ = head.training_loss(teacher, batch, settings, steps=3, train=False)
    assert torch.isfinite(dpace) and abs(float(dpace.detach()) - float(decay.detach())) > 1e-3
    grads = torch.autograd.grad(dpace, head.fc.weight)
    assert torch.isfinite(grads[0]).all() and grads[0].abs().max() > 0
