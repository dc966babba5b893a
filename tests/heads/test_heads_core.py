"""Heads: shapes, cache/mask semantics, draft vocab, save/load, target checks (tiny random targets)."""
import pytest
import torch
from helpers import tiny_target

from eaglekit.export import load_head
from eaglekit.heads import (
    Eagle1Head,
    Eagle3Head,
    HeadCache,
    HeadConfig,
    build_head,
    causal_mask,
    ttt_attention,
    ttt_mask,
)
from eaglekit.heads.ttt_attention import TTTCache

KINDS = [("eagle1", 1), ("eagle1", 2), ("eagle3", 1), ("eagle3", 2)]


@pytest.fixture(scope="module")
def target():
    return tiny_target(layers=6, hidden=32, vocab_size=64)


def make_head(target, kind, layers, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = HeadConfig.from_target(target, kind=kind, num_layers=layers, **kw)
    head = build_head(cfg, target)
    with torch.no_grad():  # random norms too, so swapped or skipped norms change the output
        for n, p in head.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.uniform_(0.5, 1.5)
    return head


def features(target, head, ids):
    out = target.forward(ids, layer_ids=head.taps)  # the head names its taps (none for EAGLE-1)
    return head.fuse_output(out)


def test_heads_config_from_target_copies_shape(target):
    cfg = HeadConfig.from_target(target, kind="eagle3")
    tc = target.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (32, tc.num_attention_heads,
                                                                                  tc.num_key_value_heads)
    assert cfg.head_dim == 32 // tc.num_attention_heads and cfg.intermediate_size == tc.intermediate_size
    assert cfg.draft_vocab_size == 64 and cfg.aux_layer_ids == [2, 3, 3]
    assert cfg.target_fingerprint == target.fingerprint() and cfg.target_num_layers == 6
    assert HeadConfig.from_dict(cfg.to_dict()) == cfg
    assert HeadConfig.from_target(target, kind="eagle1").draft_vocab_size == 64


@pytest.mark.parametrize("kind,layers", KINDS)
def test_heads_step_shapes(target, kind, layers):
    head = make_head(target, kind, layers, draft_vocab_size=40 if kind == "eagle3" else None)
    ids = torch.randint(0, 64, (2, 7))
    g = features(target, head, ids)
    assert g.shape == (2, 7, 32)
    hidden, logits = head.step(ids, g, torch.arange(7).expand(2, 7))
    vd = 40 if kind == "eagle3" else 64
    assert hidden.shape == (2, 7, 32) and logits.shape == (2, 7, vd)
    assert torch.isfinite(logits).all()
    # only head weights are trainable/saved; the borrowed target modules are not part of the head
    names = set(head.state_dict())
    assert not any("embed" in n for n in names) and all(not n.startswith("lm_head") or kind == "eagle3" for n in names)
    assert len(head.layers) == layers
    if kind == "eagle3":
        assert head.fc.weight.shape == (32, 96) and head.fc.bias is None
        assert head.layers[0].self_attn.q_proj.weight.shape[1] == 64
    else:
        assert head.fc.weight.shape == (32, 64) and head.fc.bias is not None
        assert not hasattr(head.layers[0], "input_layernorm")


@pytest.mark.parametrize("kind,layers", KINDS)
def test_heads_cache_one_at_a_time_equals_full(target, kind, layers):
    head = make_head(target, kind, layers)
    ids = torch.randint(0, 64, (2, 9))
    g = features(target, head, ids)
    pos = torch.arange(9).expand(2, 9)
    full_h, full_l = head.step(ids, g, pos)
    cache = HeadCache()
    hs, ls = [], []
    for t in range(9):
        h, lg = head.step(ids[:, t:t + 1], g[:, t:t + 1], pos[:, t:t + 1], cache=cache)
        hs.append(h)
        ls.append(lg)
        assert cache.length == t + 1
    torch.testing.assert_close(torch.cat(hs, 1), full_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(ls, 1), full_l, atol=1e-5, rtol=1e-5)
    # causality: changing the last token changes only the last output
    ids2 = ids.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % 64
    h2, _ = head.step(ids2, g, pos)
    torch.testing.assert_close(h2[:, :-1], full_h[:, :-1])
    assert (h2[:, -1] - full_h[:, -1]).abs().max() > 1e-3


def test_heads_explicit_mask_equals_default(target):
    head = make_head(target, "eagle3", 2)
    ids = torch.randint(0, 64, (1, 6))
    g = features(target, head, ids)
    pos = torch.arange(6)[None]
    c1, c2 = HeadCache(), HeadCache()
    head.step(ids[:, :4], g[:, :4], pos[:, :4], cache=c1)
    head.step(ids[:, :4], g[:, :4], pos[:, :4], cache=c2, attn_mask=causal_mask(4))
    a = head.step(ids[:, 4:], g[:, 4:], pos[:, 4:], cache=c1)[0]
    b = head.step(ids[:, 4:], g[:, 4:], pos[:, 4:], cache=c2, attn_mask=causal_mask(2, 4))[0]
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="attn_mask must be"):
        head.step(ids[:, 4:], g[:, 4:], pos[:, 4:], cache=c1, attn_mask=causal_mask(2, 3))
    with pytest.raises(ValueError, match="position_ids"):
        head.step(ids, g, None)


@pytest.mark.parametrize("layers", [1, 2])
def test_heads_ttt_mask_equals_steps_one_by_one(target, layers):
    """Batched training-time test (K steps, feedback, ttt_mask) == drafting each prefix's chain alone."""
    head = make_head(target, "eagle3", layers)
    S, K = 6, 3
    ids = torch.randint(0, 64, (1, S + K))  # element t at step k reads token ids[t + k]
    g = features(target, head, ids[:, :S])
    cache, feed, outs = HeadCache(), g, []
    for k in range(K):
        pos = (torch.arange(S) + k)[None]
        h, lg = head.step(ids[:, k:k + S], feed, pos, cache=cache, attn_mask=ttt_mask(S, k))
        outs.append((h, lg))
        feed = h
    assert cache.length == K * S
    for t in range(S):
        c = HeadCache()
        head.step(ids[:, :t + 1], g[:, :t + 1], torch.arange(t + 1)[None], cache=c)  # step 0 over the prefix
        h_prev = head.step(ids[:, :t + 1], g[:, :t + 1], torch.arange(t + 1)[None])[0][:, t:t + 1]
        torch.testing.assert_close(h_prev, outs[0][0][:, t:t + 1], atol=1e-5, rtol=1e-5)
        for k in range(1, K):
            h, lg = head.step(ids[:, t + k:t + k + 1], h_prev, torch.tensor([[t + k]]), cache=c)
            torch.testing.assert_close(h, outs[k][0][:, t:t + 1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lg, outs[k][1][:, t:t + 1], atol=1e-5, rtol=1e-5)
            h_prev = h


def test_heads_cache_crop_keep_clone():
    c = HeadCache()
    k = torch.arange(2 * 2 * 5 * 3, dtype=torch.float32).view(2, 2, 5, 3)
    c.update(0, k, -k)
    d = c.clone()
    c.keep(torch.tensor([0, 2, 4]))
    assert c.length == 3 and torch.equal(c.keys[0], k[:, :, [0, 2, 4]]) and torch.equal(c.values[0], -k[:, :, [0, 2, 4]])
    assert d.length == 5
    d.keep(torch.tensor([[4, 1], [0, 3]]))
    assert torch.equal(d.keys[0][0], k[0, :, [4, 1]]) and torch.equal(d.keys[0][1], k[1, :, [0, 3]])
    c.crop(1)
    assert c.length == 1 and torch.equal(c.keys[0], k[:, :, :1])



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_ttt_cache_expands_each_step_once(monkeypatch, dtype):
    """A TTTCache expands each step's grouped-query keys and values once, as they arrive, and its attention is
    ttt_attention's over the raw keys of the steps so far, bit for bit (bf16: widened once, step 0 narrowed
    back exactly)."""
    calls = []
    expand = ttt_attention._expand
    monkeypatch.setattr(ttt_attention, "_expand", lambda q, t: calls.append(1) or expand(q, t))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=g).to(dtype)
    ks, vs = ([torch.randn(2, 2, 9, 8, generator=g).to(dtype) for _ in range(4)] for _ in range(2))
    cache = TTTCache()
    for k in range(4):
        before = len(calls)
        got = cache.attend(0, q, ks[k], vs[k])
        assert len(calls) - before == 2  # this step's keys and values only
        assert got.dtype == dtype and torch.equal(got, ttt_attention.ttt_attention(q, ks[:k + 1], vs[:k + 1]))
    assert cache.length == 4 * 9
    with pytest.raises(ValueError, match="step 4 of layer 0 has keys"):
        cache.attend(0, q, ks[0][:, :, :5], vs[0][:, :, :5])


def test_heads_ttt_cache_refuses_a_mask(target):
    """Attention calls every cache the same way (``attend``); a TTTCache's pattern is fixed, so a step that
    brings a mask is refused by name (past the step's mask-shape check, which reads the cache's length)."""
    head = make_head(target, "eagle3", 1)
    ids = torch.randint(0, 64, (1, 5))
    g = features(target, head, ids)
    cache = TTTCache()
    head.step(ids, g, torch.arange(5)[None], cache=cache)
    with pytest.raises(ValueError, match="a TTTCache takes no attn_mask"):
        head.step(ids, g, torch.arange(1, 6)[None], cache=cache, attn_mask=ttt_mask(5, 1))

def test_heads_draft_vocab_maps(target):
    head = make_head(target, "eagle3", 1, draft_vocab_size=4)
    assert head.draft_to_target(torch.arange(4)).tolist() == [0, 1, 2, 3]  # identity until set
    keep = torch.tensor([5, 9, 10, 40])
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[keep] = True
    head.set_draft_vocab(keep - torch.arange(4), t2d)
    assert head.draft_to_target(torch.tensor([[0, 3], [1, 2]])).tolist() == [[5, 40], [9, 10]]
    assert head.target_to_draft(torch.tensor([5, 6, 40, 10])).tolist() == [0, -1, 3, 2]
    with pytest.raises(ValueError, match="t2d"):
        head.set_draft_vocab(keep - torch.arange(4), torch.zeros(64, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"'d2t' has shape \[5\], but the draft vocabulary has 4 ids"):
        head.set_draft_vocab(torch.zeros(5, dtype=torch.long), t2d)
    e1 = make_head(target, "eagle1", 1)
    assert e1.target_to_draft(torch.tensor([3, 63])).tolist() == [3, 63]


@pytest.mark.parametrize("kind,layers", KINDS)
def test_heads_save_load_bit_exact(target, kind, layers, tmp_path):
    head = make_head(target, kind, layers, draft_vocab_size=8 if kind == "eagle3" else None)
    if kind == "eagle3":
        keep = torch.tensor([1, 3, 5, 7, 11, 13, 17, 19])
        t2d = torch.zeros(64, dtype=torch.bool)
        t2d[keep] = True
        head.set_draft_vocab(keep - torch.arange(8), t2d)
    head.save_pretrained(tmp_path / "h")
    loaded = load_head(tmp_path / "h", target)
    assert type(loaded) is type(head) and loaded.config == head.config
    for k, v in head.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    ids = torch.randint(0, 64, (1, 5))
    g = features(target, head, ids)
    pos = torch.arange(5)[None]
    assert torch.equal(head.step(ids, g, pos)[1], loaded.step(ids, g, pos)[1])
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("change,what", [
    ({"intermediate_size": 48}, "fingerprint"),
    ({"hidden": 48}, "hidden size"),
    ({"vocab_size": 80}, "vocab size"),
    ({"layers": 8}, "layer count"),
])
def test_heads_load_refuses_other_target(target, tmp_path, change, what):
    make_head(target, "eagle3", 1).save_pretrained(tmp_path / "h")
    other = tiny_target(**{"layers": 6, "hidden": 32, "vocab_size": 64, **change})
    with pytest.raises(ValueError, match=what) as e:
        load_head(tmp_path / "h", other)
    assert str(tmp_path / "h") in str(e.value)


def test_heads_bad_folder_named(tmp_path, target):
    with pytest.raises(FileNotFoundError, match="config.json"):
        (tmp_path / "empty").mkdir() or load_head(tmp_path / "empty", target)
    make_head(target, "eagle1", 1).save_pretrained(tmp_path / "h")
    (tmp_path / "h" / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(ValueError, match="model.safetensors: cannot read"):
        load_head(tmp_path / "h", target)
    (tmp_path / "h" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_head(tmp_path / "h", target)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE])
def test_heads_decoder_layer_matches_transformers_llama(target, rope):
    """Our layer 1 (plain Llama layer) equals transformers' LlamaDecoderLayer with the same weights,
    so RoPE convention (plain and scaled), GQA and norms match what vLLM/SGLang run."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    cfg = HeadConfig.from_target(target, kind="eagle3", num_layers=2, rope_scaling=rope, rope_theta=5000.0,
                                 max_position_embeddings=512)
    head = build_head(cfg, target)
    ours = head.layers[1]
    with torch.no_grad():
        for p in ours.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    lcfg = head.config.llama_config()
    lcfg._attn_implementation = "eager"
    ref = LlamaDecoderLayer(lcfg, layer_idx=1).eval()
    ref.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(1, 5, 32)
    pos = torch.tensor([[3, 4, 50, 200, 201]])  # far positions exercise the scaled low frequencies
    cos, sin = LlamaRotaryEmbedding(lcfg)(x, pos)
    c, s = head.rotary(pos, torch.float32)
    torch.testing.assert_close(c, cos, atol=1e-6, rtol=1e-6)
    mask = causal_mask(5)
    out_ref = ref(x, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))
    out_ref = out_ref[0] if isinstance(out_ref, tuple) else out_ref
    torch.testing.assert_close(ours(x, c, s, None, None), out_ref, atol=1e-5, rtol=1e-5)


def test_heads_qwen2_target(tmp_path):
    """A Qwen2 target (RoPE theta from rope_parameters, biased q/k/v in the target): the head copies the shape."""
    q = tiny_target("qwen2", layers=4, hidden=32, vocab_size=64, rope_theta=1e6)
    cfg = HeadConfig.from_target(q, kind="eagle3", num_layers=1)
    assert cfg.rope_theta == 1e6 and cfg.aux_layer_ids == [2, 2, 1] and cfg.target_num_layers == 4
    head = build_head(cfg, q)
    ids = torch.randint(0, 64, (1, 5))
    _, logits = head.step(ids, features(q, head, ids), torch.arange(5)[None])
    assert logits.shape == (1, 5, 64)
    head.save_pretrained(tmp_path / "q")
    assert load_head(tmp_path / "q", q).config == cfg


def test_heads_wrong_kind_and_unbound(target):
    cfg = HeadConfig.from_target(target, kind="eagle1")
    with pytest.raises(ValueError, match="eagle3"):
        Eagle3Head(cfg)
    head = Eagle1Head(cfg)
    with pytest.raises(RuntimeError, match="bind"):
        head.step(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, 32), torch.zeros(1, 1, dtype=torch.long))


def test_heads_dtype_and_device_cached_and_kept_under_conversions(target):
    """``head.dtype`` / ``.device`` are read every decode step: cached, not a scan of the parameters per read,
    and still right after ``.to()`` / ``.half()`` / ``.float()`` and a parent module's ``.to()``."""
    head = make_head(target, "eagle3", 1)
    assert (head.dtype, head.device) == (torch.float32, torch.device("cpu"))
    head.parameters = lambda *a, **k: pytest.fail("head.dtype scanned the parameters again")
    assert head.dtype == torch.float32 and head.device == torch.device("cpu")  # from the cache
    del head.parameters
    head.to(torch.float64)
    assert head.dtype == torch.float64 == head.fc.weight.dtype
    head.half()
    assert head.dtype == torch.float16
    torch.nn.ModuleList([head]).float()  # a wrapper's conversion reaches the head's _apply too
    assert head.dtype == torch.float32
    ids = torch.randint(0, 64, (1, 4))
    _, logits = head.step(ids, features(target, head, ids), torch.arange(4)[None])
    assert logits.dtype == torch.float32
