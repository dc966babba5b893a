"""The two sample-efficiency experiments (measured 2026-11-30: benchmarks/results/cpu/recipes-500k/): HASS-style top-K
distillation and the EAGLE-3 layer started from the target's last layer."""
import pytest
import torch
from helpers import tiny_target

from eaglekit.heads import HeadConfig, build_head
from eaglekit.heads.objectives import soft_cross_entropy, topk_cross_entropy
from eaglekit.train.config import load_train_config


def _inputs(seed=0, N=13, H=8, Vd=20):
    g = torch.Generator().manual_seed(seed)
    hidden, w = torch.randn(N, H, generator=g), torch.randn(Vd, H, generator=g)
    student = torch.randn(N, Vd, generator=g) * 2
    row_w = (torch.rand(N, generator=g) > 0.3).float()
    return student, hidden, w, row_w


def test_topk_ce_with_every_token_is_the_soft_ce_and_a_smaller_k_keeps_the_top():
    student, hidden, w, row_w = _inputs()
    a, b = student.clone().requires_grad_(True), student.clone().requires_grad_(True)
    full = topk_cross_entropy(a, hidden, w, row_w, k=w.shape[0], chunk=5)
    ref = soft_cross_entropy(b, hidden, w, row_w, chunk=5)
    full.backward(), ref.backward()
    assert torch.allclose(full, ref, rtol=1e-5) and torch.allclose(a.grad, b.grad, atol=1e-6)
    # k = 1: the teacher's most likely token only, by hand
    p = torch.softmax(hidden @ w.T, -1)
    top_p, top_i = p.max(-1)
    by_hand = -(row_w * top_p * torch.log_softmax(student, -1).gather(1, top_i[:, None])[:, 0]).sum()
    assert torch.allclose(topk_cross_entropy(student, hidden, w, row_w, k=1), by_hand, rtol=1e-5)


def test_layer_from_target_is_the_targets_last_layer_on_g():
    target = tiny_target(seed=3)
    head = build_head(HeadConfig.from_target(target, kind="eagle3", draft_vocab_size=32), target)
    head.init_layer_from_target(target)
    layer, H = head.layers[0], target.hidden_size
    with torch.no_grad():
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            assert proj.weight[:, :H].abs().max() > 0  # the embedding half is kept (scaled), not dropped
            proj.weight[:, :H].zero_()  # ... zeroed here so the layer reads g alone
        torch.manual_seed(0)
        g, ids, pos = torch.randn(1, 7, H), torch.randint(0, 64, (1, 7)), torch.arange(7)[None]
        ours = layer(head.embed(ids), g, *head.rotary(pos, torch.float32))
        src = target.layers[-1]
        theirs = src(g, attention_mask=None, position_ids=pos,
                     position_embeddings=target.decoder.rotary_emb(g, pos))
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()


def test_layer_from_target_is_eagle3_only():
    from eaglekit.train.build import build_train_head
    from eaglekit.train.sources import Sources

    cfg = load_train_config(None, ["data.conversations=x.jsonl", "head.kind=eagle1", "head.init_layer_from_target=true"])
    target = tiny_target()
    sources = Sources(train=None, eval=None, d2t=None, t2d=None, layer_ids=(), where="test")
    with pytest.raises(ValueError, match="EAGLE-3 only"):
        build_train_head(cfg, target, sources)


def test_head_mlp_width_is_the_targets_unless_set():
    """head.intermediate_size narrows the head's MLP (a cheaper draft on a CPU); 0 keeps the target's."""
    from eaglekit.train.build import build_train_head
    from eaglekit.train.sources import Sources

    target = tiny_target()
    sources = Sources(train=None, eval=None, d2t=None, t2d=None, layer_ids=(), where="test")
    for width, want in ((0, target.config.intermediate_size), (24, 24)):
        cfg = load_train_config(None, ["data.conversations=x.jsonl", f"head.intermediate_size={width}"])
        head = build_train_head(cfg, target, sources)
        assert head.config.intermediate_size == want
        assert {m.out_features for n, m in head.named_modules() if n.endswith("up_proj")} == {want}
