"""Heads on a real target (SmolLM2-135M): build, fuse real taps, step with a cache."""
import pytest
import torch

from eaglekit.heads import HeadCache, HeadConfig, build_head


@pytest.mark.real
def test_heads_eagle3_on_smollm2_real_taps(smollm2):
    t = smollm2
    cfg = HeadConfig.from_target(t, kind="eagle3")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (576, 9, 3, 64)
    assert cfg.draft_vocab_size == 32000 and cfg.aux_layer_ids == [2, 15, 27] and cfg.rope_theta == 100000.0
    torch.manual_seed(0)
    head = build_head(cfg, t)
    ids = t.tokenizer("The capital of France is Paris, and", return_tensors="pt")["input_ids"]
    S = ids.shape[1]
    out = t.forward(ids, layer_ids=head.taps)
    assert out.taps.shape == (1, S, 3 * 576)
    g = head.fuse_output(out)
    # pair (g_t, x_{t+1}) at position t: the head reads the next token
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    tokens = torch.cat([ids[:, 1:], nxt], dim=1)
    cache = HeadCache()
    hidden, logits = head.step(tokens, g, torch.arange(S)[None], cache=cache)
    assert hidden.shape == (1, S, 576) and logits.shape == (1, S, 32000) and cache.length == S
    assert torch.isfinite(logits).all()
    # one more drafted level fed back from the head's own output
    d = head.draft_to_target(logits[:, -1:].argmax(-1))
    h2, l2 = head.step(d, hidden[:, -1:], torch.tensor([[S]]), cache=cache)
    assert l2.shape == (1, 1, 32000) and cache.length == S + 1
    ref_h, _ = head.step(torch.cat([tokens, d], 1), torch.cat([g, hidden[:, -1:]], 1), torch.arange(S + 1)[None])
    torch.testing.assert_close(h2, ref_h[:, -1:], atol=1e-4, rtol=1e-4)
