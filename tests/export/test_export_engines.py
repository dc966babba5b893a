"""Exports read the way each engine's loader reads them (export.engines), for 3 and 4 taps and custom taps.

``engine_logits`` plays an engine from the exported files alone: it takes the tap ids from where the
engine reads them, captures the target's hidden states the way the engine does (HF
``output_hidden_states``: index k = the input of layer k), sizes ``fc`` from where the engine reads
the count, applies only the flags the engine honours, maps the weight names as its loader does, and
drafts. Its logits must equal eaglekit's own head.
"""
import json

import pytest
import torch
from helpers import scramble_head, tiny_target
from safetensors.torch import load_file

from eaglekit.export import export_head, load_head
from eaglekit.export.engines import (
    ENGINES,
    LAYOUT_ENGINES,
    TAP_KEY,
    captured_layers,
    get_path,
    read_flag,
    read_tap_count,
)
from eaglekit.export.formats import ExportError
from eaglekit.heads import HeadConfig, build_head
from eaglekit.heads.io import check_finite
from eaglekit.heads.objectives import ttt_unroll

H, V, VD, N = 32, 64, 16, 12  # hidden, vocab, draft vocab, target layers (default taps [2, 6, 9])
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_target(layers=N, hidden=H, vocab_size=V)


def make(target, taps=None, seed=0, draft_vocab=VD, **kw):
    torch.manual_seed(seed)
    head = build_head(HeadConfig.from_target(target, kind="eagle3", draft_vocab_size=draft_vocab,
                                             aux_layer_ids=taps, **kw), target)
    return scramble_head(head, V, draft_vocab)


def drafts(head, ids, g, steps):
    """The head's logits for ``steps`` chained draft steps (step k > 0 reads step k-1's hidden state)."""
    return torch.cat([logits for _, _, logits in ttt_unroll(head, ids, g, steps)])


def eaglekit_logits(target, head, ids, steps=1):
    """Target-vocabulary logits of eaglekit's head (-inf outside the draft vocabulary)."""
    g = head.fuse(target.forward(ids, layer_ids=head.taps).taps)
    logits = drafts(head, ids, g, steps)
    out = torch.full((*logits.shape[:-1], V), float("-inf"))
    out[..., torch.arange(logits.shape[-1]) + head.d2t] = logits
    return out


def engine_logits(out_dir, engine_name, target, ids, steps=1):
    """What ``engine_name`` drafts from the exported folder (see the module docstring)."""
    engine = ENGINES[engine_name]
    config = json.loads((out_dir / "config.json").read_text())
    weights = load_file(str(out_dir / "model.safetensors"))
    assert config["architectures"][0] in engine.architectures
    raw = next((get_path(config, p) for p in engine.tap_ids_at if get_path(config, p)), None)
    inputs = [i - engine.tap_offset for i in raw] if raw else [2, N // 2, N - 3]
    layers = captured_layers(inputs, engine)
    n_fc = read_tap_count(config, engine)
    assert n_fc == len(layers), f"{engine_name}: fc sized for {n_fc} taps, {len(layers)} captured"
    assert list(weights["fc.weight"].shape) == [H, n_fc * H], f"{engine_name} would not load fc"
    llama = config.get("transformer_layer_config", config)
    # the engine's module names, mapped back to eaglekit's to run the same math
    state = {}
    for name, w in weights.items():
        for old, new in engine.key_map.items():
            name = name.replace(old, new)
        state[name] = w
    state.pop("embed_tokens.weight", None)  # shared with the target
    vd = config["draft_vocab_size"]
    d2t = state.pop("d2t", torch.zeros(vd, dtype=torch.long))  # vLLM: draft_id_to_target_id, SGLang: hot ids
    state.pop("t2d", None)  # both skip it
    cfg = HeadConfig(kind="eagle3", num_layers=llama["num_hidden_layers"], hidden_size=llama["hidden_size"],
                     target_vocab_size=llama["vocab_size"], draft_vocab_size=vd, target_num_layers=N,
                     aux_layer_ids=layers, num_attention_heads=llama["num_attention_heads"],
                     num_key_value_heads=llama["num_key_value_heads"], head_dim=llama["head_dim"],
                     intermediate_size=llama["intermediate_size"], rms_norm_eps=llama["rms_norm_eps"],
                     rope_theta=llama["rope_theta"], max_position_embeddings=llama["max_position_embeddings"],
                     norm_before_residual=bool(read_flag(config, engine, "norm_before_residual")),
                     fc_norm=bool(read_flag(config, engine, "fc_norm")),
                     norm_output=bool(read_flag(config, engine, "norm_output")),
                     norm_before_fc=bool(read_flag(config, engine, "norm_before_fc")))
    sim = build_head(cfg, target)
    sim.load_state_dict({**state, "d2t": sim.d2t, "t2d": sim.t2d}, strict=True)
    hidden = target.model(ids, output_hidden_states=True).hidden_states  # [k] = input of layer k
    g = sim.fuse(torch.cat([hidden[k] for k in layers], dim=-1))
    logits = drafts(sim, ids, g, steps)
    out = torch.full((*logits.shape[:-1], V), float("-inf"))
    out[..., torch.arange(vd) + d2t] = logits
    return out


CASES = [  # (taps, norm_before_residual): default 3 taps, custom 3, custom 4 out of order, 4 with the flag
    (None, False), ([1, 5, 10], False), ([9, 0, 4, 7], False), ([3, 5, 8, 11], True)]


@pytest.mark.parametrize("layout", ["vllm", "sglang", "speculators"])
@pytest.mark.parametrize("taps,nbr", CASES)
def test_export_engines_read_exports_as_eaglekit_runs_them(target, tmp_path, layout, taps, nbr):
    head = make(target, taps, norm_before_residual=nbr)
    if layout == "sglang" and nbr:
        with pytest.raises(ExportError, match="norm_before_residual"):
            export_head(head, tmp_path / "x", layout, verifier="me/tiny")
        return
    out = export_head(head, tmp_path / "x", layout, verifier="me/tiny")
    ids = torch.randint(0, V, (1, 7))
    want = eaglekit_logits(target, head, ids)
    for engine in LAYOUT_ENGINES[layout]:
        torch.testing.assert_close(engine_logits(out, engine, target, ids), want, atol=1e-5, rtol=1e-5)
    back = load_head(out, target)  # eaglekit reads every layout back
    torch.testing.assert_close(eaglekit_logits(target, back, ids), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("taps", [None, [9, 0, 4, 7]])
def test_export_engines_config_fields_written_out(target, tmp_path, taps):
    """The engines' meanings written out by hand (not from the table): vLLM layer inputs, SGLang outputs."""
    head = make(target, taps, norm_before_residual=False)
    want = sorted(head.config.aux_layer_ids)
    vllm = json.loads((export_head(head, tmp_path / "v", "vllm") / "config.json").read_text())
    assert vllm[TAP_KEY] == want and vllm["eagle_config"][TAP_KEY] == want
    assert vllm["eagle_config"]["use_aux_hidden_state"] is True and vllm["norm_before_residual"] is False
    sgl = json.loads((export_head(head, tmp_path / "s", "sglang") / "config.json").read_text())
    assert sgl["eagle_config"][TAP_KEY] == [t - 1 for t in want] and TAP_KEY not in sgl
    spec = json.loads((export_head(head, tmp_path / "p", "speculators", verifier="me/x") / "config.json").read_text())
    assert spec[TAP_KEY] == want and spec["transformer_layer_config"]["eagle_config"][TAP_KEY] == want
    for cfg in (vllm, sgl, spec):
        assert cfg["eaglekit"]["aux_layer_ids"] == want  # the head as written: fc blocks in sorted order


def test_export_engines_table_matches_the_engine_sources():
    """The facts the exporter relies on, as read in each engine's source (see export.engines.sources)."""
    vllm, sgl, spec, vspec = (ENGINES[n] for n in ("vllm", "sglang", "speculators", "vllm-speculators"))
    assert vllm.tap_offset == 0 and vllm.tap_ids_at == (TAP_KEY, f"eagle_config.{TAP_KEY}")
    assert sgl.tap_offset == -1 and sgl.tap_ids_at == (f"eagle_config.{TAP_KEY}",)
    assert sgl.fixed == {"norm_before_residual": False} and "norm_before_residual" not in sgl.flags
    assert vllm.flags["norm_before_residual"] is False and vspec.flags["norm_before_residual"] is True
    assert read_tap_count({}, vllm) == read_tap_count({}, sgl) == 3  # fc = 3*H when nothing says otherwise
    assert read_tap_count({"eagle_config": {TAP_KEY: [1, 2, 3, 4]}}, vllm) == 4
    assert read_tap_count({TAP_KEY: [1, 2, 3, 4]}, vllm) == 3  # vLLM sizes fc from eagle_config only
    assert spec.verifier_at == vspec.verifier_at == "speculators_config.verifier.name_or_path"
    assert vspec.verifier_must_be_hub_id and not spec.verifier_must_be_hub_id
    assert captured_layers([9, 0, 4, 4], vllm) == [0, 4, 9]
    for e in ENGINES.values():
        assert e.version and e.sources and all(":" in line for line in e.sources.values())
    for e in (vllm, sgl, spec, vspec):  # EAGLE 3.1's flags: read by every EAGLE-3 engine, off when absent
        assert read_flag({}, e, "fc_norm") is False and read_flag({}, e, "norm_output") is False
        assert read_flag({"fc_norm": True, "norm_output": True}, e, "fc_norm") is True
        assert read_flag({}, e, "norm_before_fc") is False and read_flag({"norm_before_fc": True}, e, "norm_before_fc")
    assert ENGINES["safeailab-eagle"].fixed == {"fc_norm": False, "norm_output": False, "norm_before_fc": False}


@pytest.mark.parametrize("norm", ["fc_norm", "norm_before_fc"])
@pytest.mark.parametrize("layout", ["vllm", "sglang", "speculators"])
def test_export_engines_run_eagle31_heads_as_eaglekit_does(target, tmp_path, layout, norm):
    """fc_norm (or norm_before_fc) and norm_output as each engine reads them: two chained draft steps, taps out
    of order (each tap's norm, or its slice of the one norm, moves with its fc block)."""
    head = make(target, [9, 0, 4, 7], norm_output=True, **{norm: True})
    out = export_head(head, tmp_path / "x", layout, verifier="me/tiny")
    ids = torch.randint(0, V, (1, 7))
    want = eaglekit_logits(target, head, ids, steps=2)
    for engine in LAYOUT_ENGINES[layout]:
        torch.testing.assert_close(engine_logits(out, engine, target, ids, steps=2), want, atol=1e-5, rtol=1e-5)
    plain = make(target, [9, 0, 4, 7])  # an engine that skipped either flag would draft this
    plain.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith(("fc_norm", "input_norm"))})
    assert not torch.allclose(eaglekit_logits(target, plain, ids, steps=2), want, atol=1e-3)


def test_export_engines_refusals(target, tmp_path):
    with pytest.raises(ExportError, match=r"repeat layer\(s\) \[4\]"):
        export_head(make(target, [2, 4, 4]), tmp_path / "a", "vllm")
    head = make(target, None, norm_before_residual=True)
    with pytest.raises(ExportError, match="does not read norm_before_residual"):
        export_head(head, tmp_path / "b", "sglang")
    assert not (tmp_path / "b").exists()
    for layout in ("vllm", "speculators"):  # these engines read the flag: written explicitly
        cfg = json.loads((export_head(head, tmp_path / layout, layout, verifier="me/x") / "config.json").read_text())
        assert cfg["norm_before_residual"] is True


def test_export_engines_full_vocab_head_has_no_vocab_maps(target, tmp_path):
    """vLLM has no draft_id_to_target_id when draft vocab == target vocab: d2t/t2d are left out."""
    head = make(target, None, draft_vocab=V)
    ids = torch.randint(0, V, (1, 6))
    for layout in ("vllm", "sglang", "speculators"):
        out = export_head(head, tmp_path / layout, layout, verifier="me/x")
        assert not {"d2t", "t2d"} & set(load_file(str(out / "model.safetensors")))
        for engine in LAYOUT_ENGINES[layout]:
            torch.testing.assert_close(engine_logits(out, engine, target, ids), eaglekit_logits(target, head, ids))
        back = load_head(out, target)
        assert torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)


def test_export_engines_foreign_sglang_config_taps_are_outputs(target, tmp_path):
    """A SpecForge/SGLang head names its taps only in eagle_config, as layer outputs: read back +1."""
    head = make(target, [1, 5, 10])
    out = export_head(head, tmp_path / "x", "sglang")
    cfg = json.loads((out / "config.json").read_text())
    for key in ("eaglekit", "eaglekit_export"):
        del cfg[key]
    assert cfg["eagle_config"][TAP_KEY] == [0, 4, 9]
    (out / "config.json").write_text(json.dumps(cfg))
    back = load_head(out, target)
    assert back.config.aux_layer_ids == [1, 5, 10]
    ids = torch.randint(0, V, (1, 5))
    torch.testing.assert_close(eaglekit_logits(target, back, ids), eaglekit_logits(target, head, ids))


def test_export_check_finite_names_the_tensor():
    with pytest.raises(ValueError, match=r"'b' holds 2 non-finite"):
        check_finite({"a": torch.ones(3), "i": torch.zeros(2, dtype=torch.long),
                      "b": torch.tensor([1.0, float("nan"), float("inf")])}, "here")


def test_export_engines_older_eaglekit_export_still_loads(target, tmp_path):
    """Exports written before the engine table (top-level fields only, 4 taps) load back unchanged."""
    head = make(target, [1, 3, 5, 10])
    out = export_head(head, tmp_path / "x", "vllm")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["eaglekit_export"], cfg["eagle_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(0, V, (1, 5))
    assert torch.equal(eaglekit_logits(target, load_head(out, target), ids), eaglekit_logits(target, head, ids))
    cfg[TAP_KEY] = [1, 3, 5, 9]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="disagrees with the head"):
        load_head(out, target)
