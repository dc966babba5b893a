"""The DSpark head (heads.dspark): DFlash's block drafter plus a previous-token logit bias chained through the
block, and a confidence head. Checked against naive references on a tiny random target: the drafted block
(the chain of argmaxes), the objective's value and gradient (distillation with the bias, plus the
confidence BCE against the analytic acceptance), a fresh head drafting as its DFlash backbone, save/load."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from dflash_reference import naive_block_logits
from helpers import fused_features, padded_feature_batch, randomize_norms, tiny_target

from eaglekit.export import load_head
from eaglekit.heads import HeadConfig, build_head
from eaglekit.heads.dflash import DFlashHead
from eaglekit.heads.dspark import DSparkHead
from eaglekit.heads.objectives import Teacher

pytestmark = pytest.mark.usefixtures("one_thread")
V, VD = 64, 40


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=4, vocab_size=V)


def dspark(target, block=5, rank=8, seed=0, fresh=False):
    torch.manual_seed(seed)
    head = build_head(HeadConfig.from_target(target, kind="dspark", num_layers=2, block_size=block,
                                             draft_vocab_size=VD, markov_rank=rank), target)
    keep = torch.randperm(V)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    head.set_draft_vocab(keep - torch.arange(VD), t2d)
    if not fresh:  # a bias as large as the logits, and random norms, so each part shows
        with torch.no_grad():
            head.markov_w2.weight.normal_(0, 0.5)
        randomize_norms(head)
    return head


def naive_chain(head, g, ids, t):
    """The block after element t: DFlash's logits, then slot by slot + W2 W1[previous token], the previous
    token being x_{t+1} for slot 1 and the argmax (a target id) of the previous slot's biased logits."""
    base = naive_block_logits(head, g, ids, t)
    prev, rows = int(ids[0, t + 1]), []
    for k in range(base.shape[0]):
        rows.append(base[k] + head.markov_w2.weight @ head.markov_w1.weight[prev])
        prev = int(rows[-1].argmax()) + int(head.d2t[int(rows[-1].argmax())])
    return torch.stack(rows)


def test_dspark_config_and_interface(target):
    head = dspark(target)
    assert isinstance(head, DSparkHead) and isinstance(head, DFlashHead) and head.parallel
    assert (head.config.kind, head.draft_depths, head.config.markov_rank) == ("dspark", 4, 8)
    assert head.markov_w1.weight.shape == (V, 8) and head.markov_w2.weight.shape == (VD, 8)
    assert head.confidence.weight.shape == (1, head.config.hidden_size + 8)
    assert HeadConfig.from_target(target, kind="dspark").markov_rank == 256  # speculators' default rank
    with pytest.raises(ValueError, match="markov_rank is DSpark's"):
        HeadConfig.from_target(target, kind="dflash", markov_rank=8)


def test_dspark_draft_is_the_chain_and_appends_context_like_dflash(target):
    head = dspark(target)
    ids, g = fused_features(target, head)
    cache = head.new_cache()
    head.draft(cache, ids[:, 1:5], g[:, :4], torch.arange(4)[None])
    pieces = head.draft(cache, ids[:, 5:10], g[:, 4:9], torch.arange(4, 9)[None])
    with torch.no_grad():
        want = naive_chain(head, g, ids, t=8)
    torch.testing.assert_close(pieces[0], want, rtol=1e-4, atol=1e-4)
    # the bias matters: without it the block is DFlash's, and a different one
    with torch.no_grad():
        assert (pieces[0] - naive_block_logits(head, g, ids, t=8)).abs().max() > 0.1


def test_dspark_fresh_head_drafts_as_its_dflash_backbone(target):
    head = dspark(target, fresh=True)  # W2 starts at zero
    flash = build_head(HeadConfig.from_target(target, kind="dflash", num_layers=2, block_size=5,
                                              draft_vocab_size=VD), target)
    flash.load_state_dict({k: v for k, v in head.state_dict().items()
                           if not k.startswith(("markov", "confidence"))})
    ids, g = fused_features(target, head)
    a = head.draft(head.new_cache(), ids[:, 1:10], g[:, :9], torch.arange(9)[None])
    b = flash.draft(flash.new_cache(), ids[:, 1:10], g[:, :9], torch.arange(9)[None])
    torch.testing.assert_close(a, b)


def naive_dspark_loss(head, teacher, batch, anchors, keep, scale, gamma, alpha):
    """The objective anchor by anchor, depth by depth: teacher-forced bias (the true previous token), soft CE
    weighted exp(-(k-1)/gamma) x scale, plus alpha x the same weight x BCE(confidence, sum min(q, p))."""
    ids, mask, last = batch["input_ids"], batch["loss_mask"], batch["last"]
    S, D, g = ids.shape[1], head.draft_depths, head.fuse(batch["taps"])
    total = torch.zeros(())
    for b in range(ids.shape[0]):
        for n in range(anchors.shape[1]):
            if not keep[b, n]:
                continue
            t = int(anchors[b, n])
            hidden, base = naive_block_logits(head, g[b:b + 1], ids[b:b + 1], t, hidden=True)
            for k in range(1, D + 1):
                if t + 1 + k >= S or not mask[b, t + 1 + k]:
                    continue
                if int(teacher.targets(last[b:b + 1, t + k:t + k + 1], 512)[0, 0]) < 0:
                    continue
                prev = ids[b, t + k]
                logits = base[k - 1] + head.markov_w2(head.markov_w1(prev))
                p = torch.softmax(last[b, t + k] @ teacher.draft_weight.T, -1)
                w = float(scale[b]) * math.exp(-(k - 1) / gamma)
                total = total - w * (p * torch.log_softmax(logits, -1)).sum()
                accept = torch.minimum(torch.softmax(logits.detach(), -1), p).sum()
                c = head.confidence(torch.cat([hidden[k - 1], head.markov_w1(prev)]))[0]
                total = total + alpha * w * F.binary_cross_entropy_with_logits(c, accept)
    return total


@pytest.mark.parametrize("cache_mb", [64.0, 0.0])  # the teacher's probabilities cached, or from its states
def test_dspark_objective_matches_naive_reference_value_and_gradient(target, cache_mb):
    head = dspark(target, block=4)
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    batch = padded_feature_batch(target, lengths=(13, 9))
    settings = SimpleNamespace(anchors=6, block_gamma=2.0, chunk_tokens=7, cache_teacher_mb=cache_mb, topk=0,
                               topk_weight=0.0, objective="kl", confidence_weight=0.7)
    loss, _ = head.training_loss(teacher, batch, settings, steps=3, train=False)
    anchors, keep, scale = head.sample_anchors(batch, 6, train=False)
    params = [head.markov_w1.weight, head.markov_w2.weight, head.confidence.weight, head.confidence.bias,
              head.fc.weight, head.layers[1].mlp.down_proj.weight, head.norm.weight]
    grads = torch.autograd.grad(loss, params)
    want = naive_dspark_loss(head, teacher, batch, anchors, keep, scale, gamma=2.0, alpha=0.7)
    want_grads = torch.autograd.grad(want, params)
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)
    for p, a, b in zip(params, grads, want_grads):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    settings.confidence_weight = 0.0  # the confidence head then trains nothing
    loss0, _ = head.training_loss(teacher, batch, settings, steps=3, train=False)
    assert torch.autograd.grad(loss0, head.confidence.weight, allow_unused=True)[0] is None
    assert float(loss0.detach()) < float(loss.detach())


def test_dspark_save_load(target, tmp_path):
    head = dspark(target)
    head.save_pretrained(tmp_path / "h")
    back = load_head(tmp_path / "h", target)
    assert type(back) is DSparkHead and back.config.to_dict() == head.config.to_dict()
    ids, g = fused_features(target, head)
    torch.testing.assert_close(back.draft(back.new_cache(), ids[:, 1:8], g[:, :7], torch.arange(7)[None]),
                               head.draft(head.new_cache(), ids[:, 1:8], g[:, :7], torch.arange(7)[None]))
