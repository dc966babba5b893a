"""Exports: exact key sets/shapes of the layouts (docs/exports.md), explicit config flags, refusals, reload."""
import json

import pytest
import torch
from helpers import save_tiny, tiny_target
from safetensors.torch import load_file, save_file

from eaglekit.export import export_head, load_head, validate_export
from eaglekit.export.formats import ExportError
from eaglekit.heads import HeadConfig, build_head

H, V, VD, I = 32, 64, 16, 64  # tiny target: hidden, vocab, draft vocab, MLP width
Q, KV = 32, 16  # 4 heads * 8, 2 kv heads * 8


def layer(prefix, width, input_norm=True, hidden_norm=False):
    keys = {f"{prefix}self_attn.q_proj.weight": [Q, width], f"{prefix}self_attn.k_proj.weight": [KV, width],
            f"{prefix}self_attn.v_proj.weight": [KV, width], f"{prefix}self_attn.o_proj.weight": [H, Q],
            f"{prefix}mlp.gate_proj.weight": [I, H], f"{prefix}mlp.up_proj.weight": [I, H],
            f"{prefix}mlp.down_proj.weight": [H, I], f"{prefix}post_attention_layernorm.weight": [H]}
    if input_norm:
        keys[f"{prefix}input_layernorm.weight"] = [H]
    if hidden_norm:
        keys[f"{prefix}hidden_norm.weight"] = [H]
    return keys


# golden key sets of the layouts (docs/exports.md) written out for the tiny shapes
GOLDEN = {
    ("sglang", 1): {"fc.weight": [H, 3 * H], **layer("midlayer.", 2 * H, hidden_norm=True), "norm.weight": [H],
                    "lm_head.weight": [VD, H], "d2t": [VD], "t2d": [V]},
    ("speculators", 2): {"fc.weight": [H, 3 * H], **layer("layers.0.", 2 * H, hidden_norm=True),
                         **layer("layers.1.", H), "norm.weight": [H], "lm_head.weight": [VD, H], "d2t": [VD],
                         "t2d": [V], "embed_tokens.weight": [V, H]},
    ("eagle1", 2): {"fc.weight": [H, 2 * H], "fc.bias": [H], **layer("layers.0.", H, input_norm=False),
                    **layer("layers.1.", H), "embed_tokens.weight": [V, H]},
}
GOLDEN[("vllm", 1)] = GOLDEN[("sglang", 1)]
GOLDEN[("speculators", 1)] = {k: v for k, v in GOLDEN[("speculators", 2)].items() if not k.startswith("layers.1.")}
GOLDEN[("eagle1", 1)] = {k: v for k, v in GOLDEN[("eagle1", 2)].items() if not k.startswith("layers.1.")}
CASES = [("sglang", 1), ("vllm", 1), ("speculators", 1), ("speculators", 2), ("eagle1", 1), ("eagle1", 2)]


@pytest.fixture(scope="module")
def target():
    return tiny_target(layers=8, hidden=H, vocab_size=V)  # default taps [2, 4, 5]


def make(target, kind, layers, seed=0):
    torch.manual_seed(seed)
    extra = {"draft_vocab_size": VD} if kind == "eagle3" else {}
    head = build_head(HeadConfig.from_target(target, kind=kind, num_layers=layers, **extra), target)
    with torch.no_grad():
        for n, p in head.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    if kind == "eagle3":
        keep = torch.arange(VD) * 3 + 1
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[keep] = True
        head.set_draft_vocab(keep - torch.arange(VD), t2d)
    return head


def logits(target, head, ids):
    g = head.fuse_output(target.forward(ids, layer_ids=head.taps))
    return head.step(ids, g, torch.arange(ids.shape[1])[None])[1]


@pytest.mark.parametrize("layout,layers", CASES)
def test_export_golden_keys_and_identical_reload(target, tmp_path, layout, layers):
    kind = "eagle1" if layout == "eagle1" else "eagle3"
    head = make(target, kind, layers)
    out = export_head(head, tmp_path / layout, layout, verifier="me/tiny-target")
    weights = load_file(str(out / "model.safetensors"))
    assert {k: list(v.shape) for k, v in weights.items()} == GOLDEN[(layout, layers)]
    cfg = json.loads((out / "config.json").read_text())
    if kind == "eagle3":
        assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
        fields = cfg.get("transformer_layer_config", cfg)
        assert fields["num_hidden_layers"] == layers and fields["vocab_size"] == V and fields["hidden_size"] == H
        assert cfg["draft_vocab_size"] == VD and cfg["target_hidden_size"] == H
        assert cfg["norm_before_residual"] is False
        assert cfg["eaglekit_export"]["layout"] == layout
        if layout == "speculators":
            assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
            assert cfg["speculators_config"]["algorithm"] == "eagle3"
            assert cfg["speculators_config"]["verifier"]["name_or_path"] == "me/tiny-target"
            assert torch.equal(weights["embed_tokens.weight"], target.embed_tokens.weight)
        else:
            assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
            assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 8
    else:
        assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == layers
        assert cfg["bias"] is True  # SafeAILab's fc bias switch
        assert torch.equal(weights["embed_tokens.weight"], target.embed_tokens.weight)  # a strict loader needs it
    back = load_head(out, target)
    ids = torch.randint(0, V, (1, 6))
    assert torch.equal(logits(target, head, ids), logits(target, back, ids))
    assert torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)


def test_export_refuses_what_a_layout_cannot_hold(target, tmp_path):
    with pytest.raises(ExportError, match="single midlayer"):
        export_head(make(target, "eagle3", 2), tmp_path / "a", "sglang")
    with pytest.raises(ExportError, match="EAGLE-3"):
        export_head(make(target, "eagle3", 1), tmp_path / "b", "eagle1")
    with pytest.raises(ExportError, match="EAGLE-1"):
        export_head(make(target, "eagle1", 1), tmp_path / "c", "vllm")
    with pytest.raises(ExportError, match="unknown export layout"):
        export_head(make(target, "eagle3", 1), tmp_path / "d", "tensorrt")
    assert not (tmp_path / "a" / "model.safetensors").exists()


def test_export_validate_export_refuses_tampering(target, tmp_path):
    out = export_head(make(target, "eagle3", 1), tmp_path / "x", "sglang")
    validate_export(out, "sglang")
    w = load_file(str(out / "model.safetensors"))
    save_file({**w, "midlayer.self_attn.rotary_emb.inv_freq": torch.ones(4)}, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="unexpected.*inv_freq"):
        validate_export(out, "sglang")
    w2 = dict(w)
    w2["lm_head.weight"] = torch.zeros(VD + 1, H)
    save_file(w2, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="lm_head.weight"):
        validate_export(out)
    w3 = {k: v for k, v in w.items() if k != "t2d"}
    save_file(w3, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="missing.*t2d"):
        load_head(out, target)
    save_file(w, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    del cfg["norm_before_residual"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="norm_before_residual"):
        validate_export(out)


def test_export_reload_refuses_other_target(target, tmp_path):
    out = export_head(make(target, "eagle3", 1), tmp_path / "x", "speculators", verifier="me/tiny")
    with pytest.raises(ValueError, match="layer count"):
        load_head(out, tiny_target(layers=10, hidden=H, vocab_size=V))


def test_export_foreign_engine_config_loads(target, tmp_path):
    """A head exported elsewhere (no eaglekit block) is rebuilt from the engine fields alone."""
    head = make(target, "eagle3", 1)
    out = export_head(head, tmp_path / "x", "vllm")
    cfg = json.loads((out / "config.json").read_text())
    for key in ("eaglekit", "eaglekit_export", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                "eagle_config", "norm_before_residual"):
        del cfg[key]  # SafeAILab's EAGLE-3 configs have none of these (engines default them)
    (out / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(out / "model.safetensors"))
    save_file({**w, "embed_tokens.weight": target.embed_tokens.weight.detach().clone()},
              str(out / "model.safetensors"))  # SpecForge exports may carry the embedding
    back = load_head(out, target)
    assert back.config.aux_layer_ids == [2, 4, 5] and back.config.norm_before_residual is False
    ids = torch.randint(0, V, (1, 5))
    assert torch.equal(logits(target, head, ids), logits(target, back, ids))


def test_export_cli_bf16(tmp_path, capsys):
    from eaglekit.cli import main
    from eaglekit.target import load_target

    tdir = save_tiny(tmp_path / "target", layers=8, hidden=H, vocab_size=V)
    target = load_target(tdir)
    head = make(target, "eagle3", 1)
    head.save_pretrained(tmp_path / "head")
    rc = main(["export", "--head", str(tmp_path / "head"), "--out", str(tmp_path / "out"), "--to", "sglang",
               "--target", str(tdir), "--dtype", "bfloat16"])
    assert rc == 0
    w = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert w["fc.weight"].dtype == torch.bfloat16 and w["d2t"].dtype == torch.int64
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = load_head(tmp_path / "out", target)
    assert back.dtype == torch.bfloat16
    torch.testing.assert_close(back.fc.weight, head.fc.weight.to(torch.bfloat16), atol=0, rtol=0)
    # target taken from the head's config this time; the CLI prints one error line and returns 2
    assert main(["export", "--head", str(tmp_path / "head"), "--out", str(tmp_path / "out"), "--to", "sglang"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    # one option style: every flag is the config key of that name (key=value, nested target section)
    rc = main(["export", f"head={tmp_path / 'head'}", f"out={tmp_path / 'kv'}", "to=sglang", f"target.name={tdir}",
               "target.dtype=bfloat16", "dtype=bfloat16"])
    assert rc == 0 and (tmp_path / "kv" / "model.safetensors").read_bytes() == \
        (tmp_path / "out" / "model.safetensors").read_bytes()


def test_export_refuses_non_finite_weights(target, tmp_path):
    head = make(target, "eagle3", 1)
    with torch.no_grad():
        head.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"'layers.0.mlp.up_proj.weight' holds 1 non-finite"):
        export_head(head, tmp_path / "a", "vllm")
    assert not (tmp_path / "a").exists()
    big = make(target, "eagle3", 1)
    with torch.no_grad():
        big.fc.weight[1, 2] = 1e6  # finite in fp32, inf once cast to fp16
    with pytest.raises(ValueError, match=r"'fc.weight' holds 1 non-finite"):
        export_head(big, tmp_path / "b", "sglang", dtype=torch.float16)
    export_head(big, tmp_path / "c", "sglang", dtype=torch.bfloat16)  # bf16 holds it


def test_export_load_head_refuses_non_finite_weights(target, tmp_path):
    head = make(target, "eagle3", 1)
    head.save_pretrained(tmp_path / "native")
    out = export_head(head, tmp_path / "exp", "speculators", verifier="me/x")
    for folder, name in ((tmp_path / "native", "norm.weight"), (out, "layers.0.hidden_norm.weight")):
        w = load_file(str(folder / "model.safetensors"))
        w[name] = w[name].clone()
        w[name][3] = float("inf")
        save_file(w, str(folder / "model.safetensors"))
        with pytest.raises(ValueError, match=rf"model.safetensors: tensor '{name}' holds 1 non-finite"):
            load_head(folder, target)


def test_export_verifier(target, tmp_path):
    from eaglekit.export.verifier import default_verifier

    assert default_verifier("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert default_verifier("qwen2.5-coder-0.5b-instruct") == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert default_verifier("qwen2.5-coder-1.5b-instruct") == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert default_verifier("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    assert default_verifier("tiny-llama") is None
    folder = save_tiny(tmp_path / "t", layers=8, hidden=H, vocab_size=V)
    assert default_verifier(str(folder)) == str(folder.resolve())
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "org/tiny-base"}))
    assert default_verifier(str(folder)) == "org/tiny-base"

    head = make(target, "eagle3", 1)  # its target is named "tiny-llama": no engine could load that
    with pytest.raises(ValueError, match="pass it with --verifier"):
        export_head(head, tmp_path / "a", "speculators")
    for bad in ("smollm2-135m-instruct", "no/such/thing", "a/b--c", str(tmp_path)):  # alias, not ORG/NAME, no config
        with pytest.raises(ValueError, match="verifier"):
            export_head(head, tmp_path / "b", "speculators", verifier=bad)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    out = export_head(head, tmp_path / "c", "speculators", verifier=str(folder))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(folder.resolve())
    out = export_head(head, tmp_path / "d", "sglang")  # SGLang reads no verifier: none needed
    assert json.loads((out / "config.json").read_text())["eaglekit_export"]["verifier"] is None
    head.config.target_name = "smollm2-135m-instruct"
    out = export_head(head, tmp_path / "e", "speculators")
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_export_cli_verifier(tmp_path, capsys):
    from eaglekit.cli import main
    from eaglekit.target import load_target

    tdir = save_tiny(tmp_path / "target", layers=8, hidden=H, vocab_size=V)
    make(load_target(tdir), "eagle3", 1).save_pretrained(tmp_path / "head")
    args = ["export", "--head", str(tmp_path / "head"), "--to", "speculators", "--target", str(tdir)]
    assert main([*args, "--out", str(tmp_path / "a"), "--verifier", "smollm2-135m-instruct"]) == 2
    assert "not a Hugging Face repo id" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert main([*args, "--out", str(tmp_path / "b"), "--verifier", "org/tiny"]) == 0
    assert "verifier org/tiny" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    assert main([*args, "--out", str(tmp_path / "c")]) == 0  # the head's target is the local folder
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tdir.resolve())
