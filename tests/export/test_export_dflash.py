"""DFlash exports read the way SGLang's and vLLM's DFlash loaders read them (heads.dflash_layout).

``engine_draft`` plays an engine from the exported files alone: the taps from where the engine reads them
(``target_layer_ids`` count layer outputs: HF ``hidden_states[id + 1]``), ``fc`` / ``hidden_norm`` /
``layers.N.*`` / ``norm`` from the file under the names its loader maps, the mask slots filled with the
target's embedding of the config's ``mask_token_id`` (vLLM: the vector of ``mask_embedding.pt`` when the
folder has one), the block size where the engine takes it, plain
bidirectional attention over [context; block], and the lm_head the engine uses (the target's, or the file's
rows + ``d2t`` in vLLM). Its draft must equal eaglekit's own head.
"""
import json

import pytest
import torch
import torch.nn.functional as F
from helpers import scramble_head, tiny_target
from safetensors.torch import load_file

from eaglekit.export import export_head, load_head
from eaglekit.export.dflash_layout import (
    DFLASH_ENGINES,
    engine_block,
    engine_causal_layers,
    engine_mask,
    engine_taps,
)
from eaglekit.export.formats import ExportError, validate_export
from eaglekit.heads import HeadConfig, build_head

H, V, N = 32, 64, 12
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=N, hidden=H, vocab_size=V)


def make(target, draft_vocab=V, taps=None, block=4, seed=0):
    torch.manual_seed(seed)
    head = build_head(HeadConfig.from_target(target, kind="dflash", num_layers=2, block_size=block,
                                             draft_vocab_size=draft_vocab, aux_layer_ids=taps), target)
    return scramble_head(head, V, draft_vocab)


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta, d):
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = torch.cat([pos[:, None].float() * inv] * 2, -1)
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * ang.cos() + half * ang.sin()


@torch.no_grad()
def engine_draft(out_dir, engine_name, target, ids):
    """Target-vocabulary logits [D, V] an engine drafts after the last token of ``ids`` [1, S]."""
    engine = DFLASH_ENGINES[engine_name]
    config = json.loads((out_dir / "config.json").read_text())
    w = load_file(str(out_dir / "model.safetensors"))
    assert config["architectures"] == ["DFlashDraftModel"] and not any(engine_causal_layers(config, engine))
    taps, mask_id = engine_taps(config, engine), engine_mask(config, engine)
    block = engine_block(config, engine, speculative_tokens=config["block_size"] - 1)
    hs = target.model(ids, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[t] for t in sorted(set(taps))], -1)  # HF index k = the input of layer k
    assert w["fc.weight"].shape[1] == feats.shape[-1], f"{engine_name} would not load fc"
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    nh, nkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    S = ids.shape[1]
    ctx = _rms(feats[0, :S - 1] @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # features of 0..S-2
    emb = target.embed_tokens.weight
    x = emb[torch.tensor([int(ids[0, -1])] + [mask_id] * (block - 1))]
    if engine_name == "vllm" and (out_dir / "mask_embedding.pt").is_file():  # vLLM's trained mask vector
        mask = torch.load(out_dir / "mask_embedding.pt", weights_only=True)
        assert mask["mask_token_id"] == mask_id
        x[1:] = mask["embedding"].float()
    pc, pb = torch.arange(S - 1), S - 1 + torch.arange(block)
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}.self_attn."
        h = _rms(x, w[f"layers.{i}.input_layernorm.weight"], eps)

        def heads(t, n):
            return t.view(t.shape[0], n, d).transpose(0, 1)

        q = _rope(_rms(heads(h @ w[p + "q_proj.weight"].T, nh), w[p + "q_norm.weight"], eps), pb, theta, d)
        kin = torch.cat([ctx, h])
        k = _rms(heads(kin @ w[p + "k_proj.weight"].T, nkv), w[p + "k_norm.weight"], eps)
        k = _rope(k, torch.cat([pc, pb]), theta, d)
        v = heads(kin @ w[p + "v_proj.weight"].T, nkv)
        rep = nh // nkv
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0))
        x = x + o.transpose(0, 1).reshape(block, -1) @ w[p + "o_proj.weight"].T
        m = _rms(x, w[f"layers.{i}.post_attention_layernorm.weight"], eps)
        mp = f"layers.{i}.mlp."
        x = x + (F.silu(m @ w[mp + "gate_proj.weight"].T) * (m @ w[mp + "up_proj.weight"].T)) @ w[mp + "down_proj.weight"].T
    hidden = _rms(x, w["norm.weight"], eps)[1:]
    if "lm_head.weight" in w:
        assert engine.own_lm_head, f"{engine_name} would ignore lm_head.weight"
        out = torch.full((block - 1, V), float("-inf"))
        out[:, torch.arange(w["d2t"].numel()) + w["d2t"]] = hidden @ w["lm_head.weight"].T
        return out
    return hidden @ target.lm_head.weight.T


def eaglekit_draft(head, target, ids):
    g = head.fuse_output(target.forward(ids, layer_ids=head.taps))
    S = ids.shape[1]
    logits = head.draft(head.new_cache(), ids[:, 1:], g[:, :S - 1], torch.arange(S - 1)[None])[0]
    out = torch.full((logits.shape[0], V), float("-inf"))
    out[:, torch.arange(logits.shape[-1]) + head.d2t] = logits
    return out


@pytest.mark.parametrize("layout,draft_vocab,taps", [("sglang", V, None), ("vllm", V, None), ("vllm", 16, [1, 5, 11]),
                                                     ("sglang", V, [3, 4, 7, 10])])
def test_dflash_export_is_read_by_the_engine_as_the_head_drafts(target, tmp_path, layout, draft_vocab, taps):
    head = make(target, draft_vocab, taps)
    out = export_head(head, tmp_path / layout, layout)
    ids = torch.randint(0, V, (1, 11))
    mine, theirs = eaglekit_draft(head, target, ids), engine_draft(out, layout, target, ids)
    torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-4)
    assert torch.equal(theirs.argmax(-1), mine.argmax(-1))
    back = load_head(out, target)  # and it loads back into the same head
    torch.testing.assert_close(eaglekit_draft(back, target, ids), mine)


def test_dflash_trained_mask_vector_is_exported_for_vllm_alone(target, tmp_path):
    """head.mask_embedding: vLLM reads the vector from mask_embedding.pt and drafts as the head does; SGLang,
    which fills mask slots from the vocabulary, is refused; an export without it removes a stale file."""
    torch.manual_seed(1)
    head = build_head(HeadConfig.from_target(target, kind="dflash", num_layers=2, block_size=4,
                                             mask_embedding=True), target)
    torch.testing.assert_close(head.mask_embedding.detach(), target.embed_tokens.weight[head.config.mask_token_id])
    head = scramble_head(head, V, V)
    with torch.no_grad():
        head.mask_embedding.normal_()  # unlike any row: a draft from the vocabulary row would differ
    out = export_head(head, tmp_path / "vllm", "vllm")
    ids = torch.randint(0, V, (1, 11))
    mine = eaglekit_draft(head, target, ids)
    torch.testing.assert_close(engine_draft(out, "vllm", target, ids), mine, rtol=1e-4, atol=1e-4)
    (out / "mask_embedding.pt").rename(tmp_path / "away.pt")
    assert not torch.allclose(engine_draft(out, "vllm", target, ids), mine, atol=1e-3)  # the file matters
    (tmp_path / "away.pt").rename(out / "mask_embedding.pt")
    back = load_head(out, target)
    assert back.config.mask_embedding and torch.equal(back.mask_embedding, head.mask_embedding)
    torch.testing.assert_close(eaglekit_draft(back, target, ids), mine)
    with pytest.raises(ExportError, match="head.mask_embedding: SGLang .* --to vllm"):
        export_head(head, tmp_path / "sglang", "sglang")
    export_head(make(target), out, "vllm", overwrite=True)
    assert not (out / "mask_embedding.pt").exists() and not load_head(out, target).config.mask_embedding
    with pytest.raises(ValueError, match="mask_embedding is a DFlash option"):
        HeadConfig.from_target(target, kind="dspark", mask_embedding=True)


def test_dflash_export_refuses_what_an_engine_cannot_hold(target, tmp_path):
    with pytest.raises(ExportError, match="draft_vocab_size 16: SGLang .* whole lm_head"):
        export_head(make(target, 16), tmp_path / "a", "sglang")
    with pytest.raises(ExportError, match=r"aux_layer_ids \[0, 5, 9\]: .* tap 0"):
        export_head(make(target, taps=[0, 5, 9]), tmp_path / "b", "vllm")
    with pytest.raises(ExportError, match=r"aux_layer_ids \[9, 5\]: .* strictly increasing"):
        export_head(make(target, taps=[9, 5]), tmp_path / "c", "vllm")
    for layout in ("speculators", "eagle1"):
        with pytest.raises(ExportError, match=f"the {layout} layout holds EAGLE heads"):
            export_head(make(target), tmp_path / layout, layout, verifier="org/model")


@pytest.mark.parametrize("change,match", [
    (lambda c: c.update(layer_types=["sliding_attention"] * 2), r"causal layers \[0, 1\]"),
    (lambda c: c.update(layer_types=["full_attention"] * 2, is_causal=True), r"causal layers \[0, 1\]"),
    (lambda c: c.update(layer_types=["full_attention"]), "cannot load layer_types"),
    (lambda c: c["dflash_config"].update(mask_token_id=7), "mask slots with token 7"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 5, 9]), r"capture taps \[2, 6, 10\]"),
    (lambda c: c["dflash_config"].update(block_size=16), "blocks of 16"),
])
def test_dflash_export_validation_reads_what_each_engine_would_run(target, tmp_path, change, match):
    out = export_head(make(target), tmp_path / "x", "sglang")
    config = json.loads((out / "config.json").read_text())
    change(config)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=match):
        validate_export(out)


@pytest.mark.parametrize("extra, vllm, sglang", [
    ({}, [False, False], [False, False]),
    ({"layer_types": ["full_attention", "full_attention"]}, [False, False], [False, False]),
    ({"layer_types": ["sliding_attention", "full_attention"]}, [True, False], [True, False]),
    ({"layer_types": ["sliding_attention"] * 2, "is_causal": False}, [False, False], [False, False]),
    ({"layer_types": ["full_attention"] * 2, "dflash_config": {"causal": True}}, [True, True], [False, False]),
    ({"layer_types": ["conv", "full_attention"]}, [False, False], [None, False]),
])
def test_dflash_engines_read_layer_types_each_their_own_way(extra, vllm, sglang):
    """vLLM: an is_causal / dflash_config.causal override, else only sliding_attention layers are causal;
    SGLang: no layer_types = bidirectional, full_attention bidirectional unless is_causal, sliding causal
    unless is_causal is false, any other type refused (None)."""
    config = {"num_hidden_layers": 2, **extra}
    assert engine_causal_layers(config, DFLASH_ENGINES["vllm"]) == vllm
    assert engine_causal_layers(config, DFLASH_ENGINES["sglang"]) == sglang


def test_dflash_folder_of_another_trainer_loads(target, tmp_path):
    """A SpecForge / z-lab style folder (no eaglekit block): taps from target_layer_ids + 1, the target's lm_head."""
    head = make(target)
    out = export_head(head, tmp_path / "x", "sglang")
    config = json.loads((out / "config.json").read_text())
    for key in ("eaglekit", "eaglekit_export", "draft_vocab_size", "block_size"):
        config.pop(key)
    (out / "config.json").write_text(json.dumps(config))
    back = load_head(out, target)
    assert back.config.kind == "dflash" and back.taps == head.taps and back.config.block_size == 4
    ids = torch.randint(0, V, (1, 9))
    torch.testing.assert_close(eaglekit_draft(back, target, ids), eaglekit_draft(head, target, ids))
    trained = export_head(make(target, 16), tmp_path / "v", "vllm")  # vLLM's own lm_head: must be the target's rows
    w = load_file(str(trained / "model.safetensors"))
    w["lm_head.weight"] = w["lm_head.weight"] + 1.0
    from safetensors.torch import save_file

    save_file(w, str(trained / "model.safetensors"))
    with pytest.raises(ExportError, match="lm_head.weight differs from the target's"):
        load_head(trained, target)
