"""A DFlash 2 head in its two layouts: the HF / z-lab layout (--to vllm: the nested dflash_config llama.cpp's
converter reads, is_causal written) and speculators' flat dflash2 form (--to speculators), each read back by
eaglekit's load_head into the same head, with or without eaglekit's own block (another trainer's folder);
speculators' own DFlash2DraftModel loads the flat form, and its convolution and selector compute eaglekit's
(an independent implementation agreeing on every fact the layout encodes); the layouts with no reader refuse."""
import json

import pytest
import torch
from helpers import fused_features, save_tiny

from eaglekit.export import export_head, load_head
from eaglekit.export.dflash2_layout import VLLM_CPU_REFUSAL
from eaglekit.export.engines import ExportError
from eaglekit.heads import HeadConfig, build_head
from eaglekit.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")
V = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tdir = save_tiny(tmp_path_factory.mktemp("verifier") / "tiny", layers=6, hidden=32, vocab_size=V)
    return tdir, load_target(tdir)


def dflash2(target):
    torch.manual_seed(0)
    head = build_head(HeadConfig.from_target(target, kind="dflash2", num_layers=2, block_size=5, draft_vocab_size=V,
                                             selector_rank=8, selector_top_k=4, conv_group_size=8,
                                             aux_layer_ids=[1, 3, 5]), target)
    with torch.no_grad():
        for n, p in head.named_parameters():
            if "_conv" in n or "candidate_selector" in n:
                p.normal_(0, 0.5)
    return head


def same_draft(a, b, target):
    ids, g = fused_features(target, a)
    args = (ids[:, 1:9], g[:, :8], torch.arange(8)[None])
    torch.testing.assert_close(b.draft(b.new_cache(), *args), a.draft(a.new_cache(), *args))


@pytest.mark.parametrize("layout", ["vllm", "speculators"])
def test_dflash2_export_layouts_load_back(tiny, tmp_path, layout):
    tdir, target = tiny
    head = dflash2(target)
    out = export_head(head, tmp_path / layout, layout, verifier=str(tdir))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    fields = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}
    if layout == "vllm":  # the nested block llama.cpp's converter reads (it detects DFlash 2 by selector_top_k)
        assert config["is_causal"] is False and config["dflash_config"] == {
            "target_layer_ids": [0, 2, 4], "mask_token_id": head.config.mask_token_id, "block_size": 5, **fields}
    else:
        assert config["speculators_model_type"] == "dflash2" and config["aux_hidden_state_layer_ids"] == [1, 3, 5]
        assert {k: config[k] for k in fields} == fields and config["sample_from_anchor"] is False
    from safetensors.torch import load_file

    names = set(load_file(out / "model.safetensors"))
    assert {"layers.1.mlp_conv.base_kernel", "layers.0.attention_conv.kernel_projection.weight",
            "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight"} <= names
    assert not {"lm_head.weight", "embed_tokens.weight", "d2t", "t2d"} & names  # the target's own
    back = load_head(out, target)
    assert back.config.to_dict() == head.config.to_dict()
    same_draft(head, back, target)
    del config["eaglekit"]  # another trainer's folder: the head from the layout's own fields
    (out / "config.json").write_text(json.dumps(config))
    foreign = load_head(out, target)
    assert foreign.config.kind == "dflash2" and foreign.config.aux_layer_ids == [1, 3, 5]
    assert (foreign.config.selector_top_k, foreign.config.conv_group_size, foreign.config.block_size) == (4, 8, 5)
    same_draft(head, foreign, target)


def test_dflash2_speculators_model_loads_it_and_computes_the_same(tiny, tmp_path):
    from speculators.models.dflash2 import DFlash2DraftModel

    tdir, target = tiny
    head = dflash2(target)
    out = export_head(head, tmp_path / "spec", "speculators", verifier=str(tdir))
    model = DFlash2DraftModel.from_pretrained(str(out))
    assert (model.config.block_size, model.config.selector_top_k, model.config.conv_group_size) == (5, 4, 8)
    theirs = model.state_dict()
    for k, v in head.state_dict().items():
        if k not in ("d2t", "t2d"):
            torch.testing.assert_close(theirs[k], v, msg=k)
    x = torch.randn(1, 10, 32)  # two blocks of 5
    ours_conv, theirs_conv = head.layers[0].attention_conv, model.layers[0].attention_conv
    with torch.no_grad():
        a, da = ours_conv.prepare(x, 5)
        b, db = theirs_conv.prepare(x)
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(ours_conv.finish(x, da, 5), theirs_conv.finish(x, db))
        hidden, prev = torch.randn(3, 32), torch.randint(0, V, (3,))
        unary = head.logits(hidden)
        cand = unary.topk(4, -1).indices
        torch.testing.assert_close(head.candidate_selector.scores(unary, hidden, prev, cand),
                                   model.candidate_selector.score_candidates(unary, hidden, prev, cand))


def test_dflash2_layouts_without_a_reader_refuse(tiny, tmp_path):
    _, target = tiny
    head = dflash2(target)
    for layout in ("sglang", "eagle1"):
        with pytest.raises(ExportError, match="no DFlash 2 reader"):
            export_head(head, tmp_path / layout, layout)
        assert not (tmp_path / layout).exists()
    assert "V2 model runner" in VLLM_CPU_REFUSAL and type(head).vllm_serves is False


def test_dflash2_to_llama_cpp_converts_the_hf_layout(tiny, tmp_path, monkeypatch):
    """``--to llama.cpp`` hands llama.cpp's converter the HF / z-lab folder (the nested dflash_config it reads;
    the converter and the target check stubbed here: tests/engines/test_llama_cpp_dflash.py runs the real ones)."""
    from pathlib import Path

    from eaglekit.engines import llama_cpp

    tdir, target = tiny
    head, seen = dflash2(target), {}

    def convert(layout, out_dir, target_dir, outtype="f16", overwrite=False):
        seen["config"] = json.loads((Path(layout) / "config.json").read_text())
        return Path(out_dir) / f"head-{outtype}.gguf"

    monkeypatch.setattr(llama_cpp, "refusal", lambda cfg: None)
    monkeypatch.setattr(llama_cpp, "target_refusal", lambda target_dir, root=None: None)
    monkeypatch.setattr(llama_cpp, "export_gguf", convert)
    export_head(head, tmp_path / "gguf", "llama.cpp", target_dir=tdir)
    assert seen["config"]["architectures"] == ["DFlash2DraftModel"]
    assert seen["config"]["dflash_config"]["selector_top_k"] == 4 and seen["config"]["is_causal"] is False


def test_dflash2_vllm_bench_reports_the_refusal_without_a_server(tiny, tmp_path, monkeypatch):
    """``eaglekit bench engine=vllm`` with a dflash2 head: vLLM's CPU backend cannot run it, so the head is
    reported as failed with the reason and no server is started for it (plain still runs; stubbed here)."""
    from eaglekit.bench import vllm as bench_vllm
    from eaglekit.bench.cli import BenchConfig
    from eaglekit.engines import vllm_cpu

    tdir, target = tiny
    head = dflash2(target)
    head.save_pretrained(tmp_path / "head")
    started = []

    class Server:
        def __init__(self, folder, speculative=None, **kw):
            started.append(speculative)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def complete(self, ids, n):
            return vllm_cpu.Completion(tokens=[1] * 4, seconds=0.1)

    monkeypatch.setattr(vllm_cpu, "require", lambda: tmp_path)
    monkeypatch.setattr(vllm_cpu, "Server", Server)
    cfg = BenchConfig(target=str(tdir), head=str(tmp_path / "head"), engine="vllm", prompts=1, repeats=1,
                      max_new_tokens=4, out=str(tmp_path / "bench"))
    report = bench_vllm.run_engine_bench(cfg)
    assert started == [None]  # plain only: no server for the head
    assert report["failed"] == {"head": {"error": VLLM_CPU_REFUSAL}} and set(report["results"]) == {"plain"}


def test_dflash2_model_card_serves_it_with_llama_cpp_and_speculators(tiny):
    from eaglekit.export import model_card

    _, target = tiny
    card = model_card(dflash2(target).config, "me/dflash2", "speculators", base_model="me/tiny")
    assert "--spec-type draft-dflash" in card and "dflash2-gguf/head-f16.gguf" in card
    assert "from speculators.models.dflash2 import DFlash2DraftModel" in card and "vllm serve" not in card
