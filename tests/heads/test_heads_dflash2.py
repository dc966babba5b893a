"""The DFlash 2 head (heads.dflash.DFlash2Head): DFlash plus an in-block dynamic convolution and a candidate
selector. Checked on a tiny random target: a fresh head drafts exactly as DFlash with the same weights (identity
convolution, zero successor codebook); the convolution against its formula written out, and never reading
across a block; the selector's greedy walk and sampled walk against a naive walk; the objective (DFlash's plus
alpha x the selector's CE, gold swapped in at rank K or the position dropped) against a naive reference, value
and gradient; save/load; the config's refusals."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import fused_features, padded_feature_batch, randomize_norms, tiny_target

from eaglekit.export import load_head
from eaglekit.heads import HeadConfig, build_head
from eaglekit.heads.dflash import DFlash2Head, DFlashHead, DynamicConv, decay_gamma, position_weights
from eaglekit.heads.objectives import Teacher

pytestmark = pytest.mark.usefixtures("one_thread")
V, K = 64, 6


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=4, vocab_size=V)


def dflash2(target, block=5, seed=0, fresh=False):
    torch.manual_seed(seed)
    head = build_head(HeadConfig.from_target(target, kind="dflash2", num_layers=2, block_size=block,
                                             draft_vocab_size=V, selector_rank=8, selector_top_k=K,
                                             conv_group_size=8), target)
    if not fresh:  # every part away from its identity start, so each shows
        with torch.no_grad():
            for layer in head.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.normal_(0.5, 0.3)
                    conv.kernel_projection.weight.normal_(0, 0.3)
            head.candidate_selector.successor_codebook.normal_(0, 1.0)
            head.candidate_selector.predecessor_codebook.normal_(0, 1.0)
            head.candidate_selector.hidden_projection.weight.normal_(0, 0.5)
        randomize_norms(head)
    return head


def naive_conv(conv, x, delta, side, block):
    """out[t, c] = sum_tap (base[side, tap, c] + delta[t, tap, c // group]) x[t - tap, c], zero where t - tap
    falls before its block's slot 0 (x [Q, H], delta [Q, K, G])."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for tap in range(conv.kernel):
            if t % block >= tap:
                w = conv.base_kernel[side, tap] + delta[t, tap].repeat_interleave(conv.group)
                out[t] += w * x[t - tap]
    return out


def test_from_target_defaults_what_each_kind_needs():
    """DFlash 2's selector needs the full vocabulary: its default is the target's, where the other kinds default to
    DEFAULT_DRAFT_VOCAB (a target larger than that is what used to contradict the kind)."""
    from helpers import tiny_target

    from eaglekit.heads.config import DEFAULT_DRAFT_VOCAB

    big = tiny_target("llama", layers=2, hidden=16, vocab_size=DEFAULT_DRAFT_VOCAB + 8)
    assert HeadConfig.from_target(big, kind="dflash2").draft_vocab_size == big.vocab_size
    for kind in ("eagle3", "dflash", "dspark"):
        assert HeadConfig.from_target(big, kind=kind).draft_vocab_size == DEFAULT_DRAFT_VOCAB


def test_dflash2_config_defaults_and_refusals(target):
    cfg = HeadConfig.from_target(target, kind="dflash2", draft_vocab_size=V)
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k, cfg.block_size) == \
        (2, 16, 256, 16, 8)  # the published recipe
    assert HeadConfig.from_target(target, kind="dflash").selector_rank == 0
    with pytest.raises(ValueError, match="selector_top_k is DFlash 2's"):
        HeadConfig.from_target(target, kind="dflash", selector_top_k=4)
    with pytest.raises(ValueError, match="full target vocabulary"):
        DFlash2Head(HeadConfig.from_target(target, kind="dflash2", draft_vocab_size=40))
    head = dflash2(target)
    assert isinstance(head, DFlashHead) and head.parallel and head.draft_depths == 4
    conv = head.layers[0].attention_conv
    assert conv.base_kernel.shape == (2, 2, 32) and conv.kernel_projection.weight.shape == (2 * 2 * 4, 32)
    sel = head.candidate_selector
    assert sel.predecessor_codebook.shape == sel.successor_codebook.shape == (V, 8)
    assert sel.hidden_projection.weight.shape == (8, 32)


def test_dflash2_fresh_head_drafts_as_dflash(target):
    head = dflash2(target, fresh=True)
    flash = build_head(HeadConfig.from_target(target, kind="dflash", num_layers=2, block_size=5,
                                              draft_vocab_size=V), target)
    flash.load_state_dict({k: v for k, v in head.state_dict().items()
                           if not k.startswith("candidate_selector") and "_conv" not in k})
    ids, g = fused_features(target, head)
    args = (ids[:, 1:10], g[:, :9], torch.arange(9)[None])
    h2, h1 = head.block_hidden(head.new_cache(), *args), flash.block_hidden(flash.new_cache(), *args)
    torch.testing.assert_close(h2, h1)  # the identity convolution
    walk = head.draft(head.new_cache(), *args)
    dfl = flash.draft(flash.new_cache(), *args)
    assert torch.equal(walk.argmax(-1), dfl.argmax(-1))  # the zero successor codebook: the unary argmax
    top = dfl.topk(K, -1)  # the walk's rows: the unary logits on the top-K, -inf elsewhere
    torch.testing.assert_close(walk.gather(-1, top.indices), top.values)
    assert int(torch.isfinite(walk).sum()) == K * 4


def test_dflash2_convolution_is_its_formula_and_never_crosses_a_block():
    torch.manual_seed(0)
    conv = DynamicConv(16, 3, 4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    block, x = 4, torch.randn(2, 12, 16)  # 3 blocks per row
    y, d = conv.prepare(x, block)
    z = conv.finish(x * 2, d, block)
    delta = conv.kernel_projection(x).view(2, 12, 2, 3, 4)
    for b in range(2):
        torch.testing.assert_close(y[b], naive_conv(conv, x[b], delta[b, :, 0], 0, block))
        torch.testing.assert_close(z[b], naive_conv(conv, x[b] * 2, delta[b, :, 1], 1, block))
    x2 = x.clone()
    x2[:, 4:8] += 10.0  # only the middle block changes
    y2, _ = conv.prepare(x2, block)
    torch.testing.assert_close(y2[:, :4], y[:, :4])
    torch.testing.assert_close(y2[:, 8:], y[:, 8:])  # the next block's slots 0..2 never read it
    assert (y2[:, 4:8] - y[:, 4:8]).abs().min() > 0


def naive_walk(head, hidden, last, pick):
    """The selector's walk, slot by slot: top-K of the unary logits, S = U + <A[prev] * W_h h, B[b]>."""
    sel, prev, toks, rows = head.candidate_selector, last, [], []
    for k in range(hidden.shape[0]):
        u = hidden[k] @ head.target_module("lm_head").weight.T
        cand = u.topk(K).indices
        s = u[cand] + sel.successor_codebook[cand] @ (sel.predecessor_codebook[prev] * (sel.hidden_projection.weight
                                                                                          @ hidden[k]))
        rows.append((cand, s))
        prev = int(cand[pick(s)])
        toks.append(prev)
    return toks, rows


def test_dflash2_greedy_walk_and_sampled_walk(target):
    head = dflash2(target)
    ids, g = fused_features(target, head)
    args = (ids[:, 1:10], g[:, :9], torch.arange(9)[None])
    with torch.no_grad():
        hidden = head.block_hidden(head.new_cache(), *args)[0]
        toks, rows = naive_walk(head, hidden, int(ids[0, 9]), lambda s: int(s.argmax()))
    walk = head.draft(head.new_cache(), *args)[0]
    assert walk.argmax(-1).tolist() == toks
    for k, (cand, s) in enumerate(rows):
        torch.testing.assert_close(walk[k, cand], s, rtol=1e-4, atol=1e-4)
    unary = head.logits(hidden).argmax(-1).tolist()
    assert toks != unary  # the selector changed the walk (random codebooks)
    # sampled: q = softmax(S / T) over the candidates after the token sampled before it
    gen = torch.Generator().manual_seed(0)
    toks_s, q = head.draft_sampled(head.new_cache(), *args, lambda row: torch.softmax(row / 0.7, -1), gen)
    assert q.shape == (1, 4, V) and torch.allclose(q.sum(-1), torch.ones(1, 4))
    picked = iter(toks_s[0].tolist())
    prev = int(ids[0, 9])
    for k in range(4):  # each slot's q is the softmax of its candidates' S after the sampled previous token
        _, rows = naive_walk(head, hidden[k:k + 1], prev, lambda s: int(s.argmax()))
        cand, s = rows[0]
        torch.testing.assert_close(q[0, k, cand], torch.softmax(s / 0.7, -1), rtol=1e-4, atol=1e-5)
        assert float(q[0, k].sum() - q[0, k, cand].sum()) == pytest.approx(0.0, abs=1e-6)
        prev = next(picked)
        assert prev in cand.tolist()


def naive_dflash2_loss(head, teacher, batch, anchors, keep, scale, gamma, alpha, missing):
    """DFlash's objective plus alpha x the selector CE per slot (gold = the teacher's argmax, predecessor =
    the true previous token), weighted exp(-(k-1)/gamma) x scale, anchor by anchor."""
    ids, mask, last = batch["input_ids"], batch["loss_mask"], batch["last"]
    S, D, g = ids.shape[1], head.draft_depths, head.fuse(batch["taps"])
    sel, total, recall = head.candidate_selector, torch.zeros(()), [0, 0]
    for b in range(ids.shape[0]):
        for n in range(anchors.shape[1]):
            if not keep[b, n]:
                continue
            t = int(anchors[b, n])
            hidden = head.blocks(ids[b:b + 1, t + 1:t + 2], torch.tensor([[t]]),
                                 [(k[:, :, :t + 1], v[:, :, :t + 1])
                                  for k, v in head.context(g[b:b + 1], torch.arange(S)[None])])[0, 0, 1:]
            for k in range(1, D + 1):
                if t + 1 + k >= S or not mask[b, t + 1 + k]:
                    continue
                u = head.logits(hidden[k - 1])
                p = torch.softmax(last[b, t + k] @ teacher.draft_weight.T, -1)
                w = float(scale[b]) * torch.exp(torch.tensor(-(k - 1) / gamma))
                total = total - w * (p * torch.log_softmax(u, -1)).sum()
                gold, prev = int(p.argmax()), int(ids[b, t + k])
                cand = u.detach().topk(K).indices.tolist()
                recall[0] += gold in cand
                recall[1] += 1
                if gold not in cand:
                    if missing == "drop":
                        continue
                    cand[-1] = gold
                cand = torch.tensor(cand)
                s = u[cand] + sel.successor_codebook[cand] @ (sel.predecessor_codebook[prev]
                                                             * (sel.hidden_projection.weight @ hidden[k - 1]))
                total = total + alpha * w * F.cross_entropy(s[None], torch.tensor([cand.tolist().index(gold)]))
    return total, recall


@pytest.mark.parametrize("missing", ["swap", "drop"])
def test_dflash2_objective_matches_naive_reference_value_and_gradient(target, missing):
    head = dflash2(target, block=4)
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    batch = padded_feature_batch(target, lengths=(13, 9))
    settings = SimpleNamespace(anchors=6, block_gamma=2.0, chunk_tokens=7, cache_teacher_mb=64.0, topk=0,
                               topk_weight=0.0, objective="kl", selector_weight=0.7, selector_missing=missing)
    loss, stats = head.training_loss(teacher, batch, settings, steps=3, train=False)
    anchors, keep, scale = head.sample_anchors(batch, 6, train=False)
    sel = head.candidate_selector
    params = [sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight,
              head.layers[0].attention_conv.kernel_projection.weight, head.layers[1].mlp_conv.base_kernel,
              head.fc.weight, head.norm.weight]
    grads = torch.autograd.grad(loss, params)
    want, recall = naive_dflash2_loss(head, teacher, batch, anchors, keep, scale, 2.0, 0.7, missing)
    want_grads = torch.autograd.grad(want, params)
    assert 0 < recall[0] < recall[1]  # some golds fall outside the top-K: swap and drop differ
    D = head.draft_depths  # the stats count the same recall (the trainer logs it as eval_candidate_recall)
    assert (sum(stats.recalled), sum(stats.total[:D]), len(stats.recalled)) == (recall[0], recall[1], D)
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(grads, want_grads):  # large random weights: fp32 rounding shows element-wise, so in norm
        assert b.abs().max() > 0 and float((a - b).norm() / b.norm()) < 1e-3, float((a - b).norm() / b.norm())
    settings.selector_weight = 0.0  # DFlash's objective alone: the selector trains nothing
    loss0, _ = head.training_loss(teacher, batch, settings, steps=3, train=False)
    assert torch.autograd.grad(loss0, sel.successor_codebook, allow_unused=True)[0] is None
    assert position_weights(3, decay_gamma(4, 2.0))[0] == 1.0
    assert sum(stats.total[:3]) > 0 and sum(stats.correct[:3]) <= sum(stats.total[:3])


def test_dflash2_stats_count_the_selectors_pick(target):
    """The accuracy stats count the selector's teacher-forced pick, not the unary argmax (with random
    codebooks they differ)."""
    head = dflash2(target, block=4)
    batch = padded_feature_batch(target, lengths=(13, 9))
    anchors = head.sample_anchors(batch, 6, train=False)[0]
    g = head.fuse(batch["taps"])
    with torch.no_grad():
        hidden = head.blocks(batch["input_ids"].gather(1, anchors + 1), anchors,
                             head.context(g, torch.arange(13)[None]),
                             (torch.arange(13)[None, None, :] <= anchors[:, :, None])[:, :, None, :]
                             .expand(2, anchors.shape[1], 4, 13).reshape(2, 1, -1, 13))[:, :, 1:]
        logits = head.logits(hidden)
        prev = torch.randint(0, V, logits.shape[:-1])
        picks = head.block_picks(hidden, prev, logits)
    assert not torch.equal(picks, logits.argmax(-1))
    b, n, k = 0, 1, 2
    _, rows = naive_walk(head, hidden[b, n, k:k + 1], int(prev[b, n, k]), lambda s: int(s.argmax()))
    cand, s = rows[0]
    assert int(picks[b, n, k]) == int(cand[s.argmax()])


def test_dflash2_save_load(target, tmp_path):
    head = dflash2(target)
    head.save_pretrained(tmp_path / "h")
    back = load_head(tmp_path / "h", target)
    assert type(back) is DFlash2Head and back.config.to_dict() == head.config.to_dict()
    ids, g = fused_features(target, head)
    args = (ids[:, 1:8], g[:, :7], torch.arange(7)[None])
    torch.testing.assert_close(back.draft(back.new_cache(), *args), head.draft(head.new_cache(), *args))
