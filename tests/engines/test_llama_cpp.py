"""eaglekit.engines.llama_cpp: what llama.cpp can serve (refused before anything is written, naming the config keys
that train a servable head), the build cache's stamp, and — slow, real — a head exported with
``export_head(..., "llama.cpp")`` drafting in a real llama-server on the embedded Q4_1 SmolLM2 file: greedy
output identical to plain llama-server, drafts accepted for a trained head and not for a random one.

The slow test builds the pinned llama.cpp the first time (~3 min on 2 cores, cached in
~/.cache/eaglekit/llama.cpp-0.3.36; `bash scripts/llama_cpp.sh` does it ahead), then takes ~1 min."""
import pytest
import torch
from helpers import SERVER_THREADS, fit_head, fit_mtp, hf_greedy, nextn_checkpoint, save_tiny, tiny_target

from eaglekit import assets
from eaglekit.bench.llama_cpp import first_diff, head_drafts, replay, top2_gap
from eaglekit.engines import llama_cpp
from eaglekit.export import export_head
from eaglekit.export.formats import ExportError
from eaglekit.heads import HeadConfig, build_head

pytestmark = pytest.mark.usefixtures("one_thread")
# plain's top-2 log-probability gap under which llama.cpp may pick either token when the same arithmetic runs in
# another order: its matmuls quantise activations to 8 bits, so a last-bit change can flip a rounding and grow
# over 24 layers (Qwen2.5-Coder-0.5B relabelled as llama, AVX2 EPYC 2026-12-05: one answer left at a gap of 0.076)
NEAR_TIE = 0.2


@pytest.fixture(scope="module")
def target():
    return tiny_target(layers=12, hidden=32, vocab_size=64)


@pytest.mark.parametrize("kind,flags,named", [
    ("eagle3", {"fc_norm": True}, "head.fc_norm=true"),
    ("eagle3", {"norm_output": True}, "head.norm_output=true"),
    ("eagle3", {"num_layers": 2}, "head.num_layers=2"),
    ("eagle3", {"aux_layer_ids": [1, 4, 7, 9]}, "taps [1, 4, 7, 9]"),
    ("peagle", {}, "this is a peagle head"),
    ("dflash", {"draft_vocab_size": 32}, "head.draft_vocab_size=32 below the target's 64"),
    ("dflash", {"mask_embedding": True}, "head.mask_embedding=true"),
    ("dflash", {"aux_layer_ids": [0, 4, 7]}, "taps [0, 4, 7]"),
    ("dspark", {"aux_layer_ids": [0, 4, 7]}, "taps [0, 4, 7]"),
    ("dflash2", {}, "hidden size 32 < selector_top_k * (selector_top_k + 1) = 272"),
    ("dflash2", {"selector_top_k": 4, "aux_layer_ids": [0, 4, 7]}, "taps [0, 4, 7]"),
    ("eagle1", {}, "this is a eagle1 head"),
])
def test_llama_cpp_refuses_what_it_cannot_serve(target, tmp_path, kind, flags, named):
    head = build_head(HeadConfig.from_target(target, kind=kind, **flags), target)
    with pytest.raises(ExportError, match="llama.cpp") as err:
        export_head(head, tmp_path / "out", "llama.cpp")
    assert named in str(err.value)
    if kind == "eagle3":  # the keys that train a head it can serve
        assert "head.fc_norm=false head.norm_output=false" in str(err.value)
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_llama_cpp_bench_serves_each_servable_kind_with_its_spec_type(target):
    """``eaglekit bench engine=llama.cpp`` knows a --spec-type for exactly the kinds export lets through, and a
    block drafter's configurations carry it (alone and combined with an n-gram type, as llama.cpp spells it)."""
    from pathlib import Path

    from eaglekit.bench.cli import BenchConfig
    from eaglekit.bench.llama_cpp import SPEC_TYPES, configurations
    from eaglekit.config import load_config
    from eaglekit.heads.config import KINDS

    servable = {k for k in KINDS if llama_cpp.refusal(HeadConfig.from_target(
        target, kind=k, **({"selector_top_k": 4} if k == "dflash2" else {}))) is None}
    assert servable == set(SPEC_TYPES) == {"eagle3", "dspark", "dflash", "dflash2"}
    cfg = load_config(BenchConfig, None, ["engine=llama.cpp", "sweep_n_max=[2]", "sweep_p_min=[]"])
    confs = configurations(cfg, Path("h.gguf"), None, (3, 0.0), SPEC_TYPES["dflash2"])
    assert confs["head"] == {"draft": Path("h.gguf"), "spec_type": "draft-dflash", "n_max": 3, "p_min": 0.0}
    assert confs["head n=2 p=0"]["spec_type"] == "draft-dflash"
    assert confs["head+ngram-mod"]["spec_type"] == "draft-dflash,ngram-mod"


def test_llama_cpp_serves_plain_and_norm_before_fc_heads(target, tmp_path):
    for flags in ({}, {"norm_before_fc": True}, {"norm_before_residual": True}):
        assert llama_cpp.refusal(HeadConfig.from_target(target, kind="eagle3", **flags)) is None
    assert llama_cpp.refusal(HeadConfig.from_target(target, kind="dflash2", selector_top_k=4)) is None
    assert llama_cpp.refusal(HeadConfig.from_target(target, kind="dflash", draft_vocab_size=64)) is None
    head = build_head(HeadConfig.from_target(target, kind="eagle3"), target)
    folder = save_tiny(tmp_path / "tiny")
    with pytest.raises(llama_cpp.LlamaCppError, match="gguf type 'q4_0'"):
        export_head(head, tmp_path / "out", "llama.cpp", target_dir=folder, gguf_type="q4_0")
    with pytest.raises(llama_cpp.LlamaCppError, match="no config.json|none there"):
        export_head(head, tmp_path / "out", "llama.cpp", target_dir=tmp_path, gguf_type="f16")
    assert not (tmp_path / "out" / "head-q4_0.gguf").exists()


def test_llama_cpp_drafts_only_for_targets_whose_graph_records_layer_inputs(target, tmp_path, monkeypatch):
    """llama.cpp's EAGLE-3 and DSpark drafts read the target's layer inputs; llama-server aborts on the first
    batch for a graph that records none. Which graphs do is read from the build (its servable.json): a target
    outside it is refused at export (the target's folder) and before a server starts (the GGUF's
    architecture), naming what it can serve; one inside it is not."""
    import json

    import gguf

    monkeypatch.setenv("EAGLEKIT_CACHE", str(tmp_path / "cache"))
    root = llama_cpp.install_dir()
    fake_build(root)
    (root / ".built").write_text(llama_cpp._stamp() + "\n")
    table = {"llama": ["LlamaForCausalLM", "MistralForCausalLM"], "qwen3": ["Qwen3ForCausalLM"]}
    (root / llama_cpp.SERVABLE_FILE).write_text(json.dumps(table))
    head = build_head(HeadConfig.from_target(target, kind="eagle3"), target)
    qwen = save_tiny(tmp_path / "qwen2", arch="qwen2")
    with pytest.raises(ExportError, match="Qwen2ForCausalLM target .*layer input tensor is null.*"
                                          r"llama \(LlamaForCausalLM, MistralForCausalLM\), qwen3"):
        export_head(head, tmp_path / "out", "llama.cpp", target_dir=qwen, gguf_type="f16")
    assert not (tmp_path / "out").exists()
    assert llama_cpp.target_refusal(save_tiny(tmp_path / "llama")) is None
    for arch in ("qwen2", "llama"):  # a GGUF holding only its metadata is enough to read the architecture
        w = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
    with pytest.raises(llama_cpp.LlamaCppError, match="the qwen2 target"):
        llama_cpp.Server(tmp_path / "qwen2.gguf", draft=tmp_path / "head.gguf", spec_type="draft-dspark", root=root)
    llama_cpp.Server(tmp_path / "llama.gguf", draft=tmp_path / "head.gguf", spec_type="draft-eagle3", root=root)
    llama_cpp.Server(tmp_path / "qwen2.gguf", draft=tmp_path / "d.gguf", spec_type="draft-simple", root=root)
    table["qwen2"] = ["Qwen2ForCausalLM"]  # what eaglekit's build records (llama_cpp.PATCHES)
    (root / llama_cpp.SERVABLE_FILE).write_text(json.dumps(table))
    assert llama_cpp.target_refusal(qwen) is None
    llama_cpp.Server(tmp_path / "qwen2.gguf", draft=tmp_path / "head.gguf", spec_type="draft-dspark", root=root)


def fake_source(src):
    """The few files of a llama.cpp source tree that the patch and read_servable look at, in their shapes."""
    (src / "src" / "models").mkdir(parents=True)
    (src / "conversion").mkdir()
    (src / "gguf-py" / "gguf").mkdir(parents=True)
    loop = "    for (int il = 0; il < n_layer; ++il) {\n        ggml_tensor * inpSA = inpL;\n    }\n"
    graph = "llama_model_{0}::graph::graph(const llama_model & model) {{\n{1}}}\n"
    (src / "src" / "models" / "qwen2.cpp").write_text(graph.format("qwen2", loop))
    (src / "src" / "models" / "llama.cpp").write_text(
        graph.format("llama", loop.replace("{\n", "{\n        res->t_layer_inp[il] = inpL;\n", 1)))
    (src / "src" / "models" / "gpt2.cpp").write_text(graph.format("gpt2", loop))
    (src / "src" / "llama-model.cpp").write_text(
        "    switch (arch) {\n        case LLM_ARCH_LLAMA:\n            return new llama_model_llama(params);\n"
        "        case LLM_ARCH_QWEN2:\n        case LLM_ARCH_QWEN2VL:\n            return new llama_model_qwen2(params);\n"
        "        case LLM_ARCH_GPT2:\n            return new llama_model_gpt2(params);\n")
    (src / "src" / "llama-arch.cpp").write_text('    { LLM_ARCH_LLAMA, "llama" },\n    { LLM_ARCH_QWEN2, "qwen2" },\n'
                                                '    { LLM_ARCH_QWEN2VL, "qwen2vl" },\n    { LLM_ARCH_GPT2, "gpt2" },\n')
    (src / "gguf-py" / "gguf" / "constants.py").write_text(
        '    MODEL_ARCH.LLAMA: "llama",\n    MODEL_ARCH.QWEN2: "qwen2",\n    MODEL_ARCH.GPT2: "gpt2",\n')
    (src / "convert_hf_to_gguf.py").write_text("")
    (src / "conversion" / "models.py").write_text(
        '@ModelBase.register(\n    "LlamaForCausalLM",\n    "MistralForCausalLM")\n# a comment\n'
        "class LlamaModel(TextModel):\n    model_arch = gguf.MODEL_ARCH.LLAMA\n\n\n"
        '@ModelBase.register("Qwen2ForCausalLM")\nclass Qwen2Model(TextModel):\n    """doc"""\n'
        "    model_arch = gguf.MODEL_ARCH.QWEN2\n\n\n"
        '@ModelBase.register("GPT2LMHeadModel")\nclass GPT2Model(TextModel):\n    model_arch = gguf.MODEL_ARCH.GPT2\n')


def test_llama_cpp_build_records_qwen2_layer_inputs_and_reads_what_it_serves_from_the_source(tmp_path):
    """The build's one-line patch puts the layer-input record first in qwen2's layer loop (once, however often
    it is applied), and read_servable finds the servable architectures from the source: the graphs recording
    layer inputs, the GGUF names of the architectures built by them, the transformers classes converted to
    those. A source without the patch's anchor is refused, naming the file."""
    src = tmp_path / "src-tree"
    fake_source(src)
    assert llama_cpp.read_servable(src) == {"llama": ["LlamaForCausalLM", "MistralForCausalLM"]}
    llama_cpp.apply_patches(src)
    llama_cpp.apply_patches(src)  # a second time changes nothing
    text = (src / "src" / "models" / "qwen2.cpp").read_text()
    assert text.count("res->t_layer_inp[il] = inpL;") == 1
    assert text.index("for (int il = 0") < text.index("t_layer_inp") < text.index("inpSA")
    assert llama_cpp.read_servable(src) == {"llama": ["LlamaForCausalLM", "MistralForCausalLM"],
                                            "qwen2": ["Qwen2ForCausalLM"], "qwen2vl": []}
    (src / "src" / "models" / "qwen2.cpp").write_text("void f() {}\n")
    with pytest.raises(llama_cpp.LlamaCppError, match="qwen2.cpp.*occurs 0 times"):
        llama_cpp.apply_patches(src)


def test_llama_cpp_build_stamp_names_what_eaglekit_changes(tmp_path, monkeypatch):
    """A cache built before a change of eaglekit's build (AMX off, the Qwen2 patch) is not used: its stamp lacks
    the changes' hash, so the next use rebuilds; on x86 the compiler is told to leave AMX out."""
    monkeypatch.setenv("EAGLEKIT_CACHE", str(tmp_path))
    root = llama_cpp.install_dir()
    fake_build(root)
    stamp = llama_cpp._stamp()
    assert f"changes={llama_cpp.BUILD_CHANGES}" in stamp
    (root / ".built").write_text(stamp.replace(f" changes={llama_cpp.BUILD_CHANGES}", "") + "\n")  # an old cache
    assert llama_cpp.installed() is None
    (root / ".built").write_text(stamp + "\n")
    assert llama_cpp.installed() == root
    assert set(llama_cpp.NO_AMX.split()) == {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"}


def test_llama_cpp_failed_install_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    """The build's last stage copies the binaries beside the cache folder and smoke-tests them: when that
    fails (here: the server crashes at start), the error says so and no folder is left behind."""
    monkeypatch.setenv("EAGLEKIT_CACHE", str(tmp_path / "cache"))
    root = llama_cpp.install_dir()
    root.parent.mkdir(parents=True)
    fake_build(tmp_path / "b")
    src = tmp_path / "src-tree"
    fake_source(src)

    def crash(tmp, log):
        raise llama_cpp.LlamaCppError("llama-server exited (killed by SIGSEGV) at start")

    monkeypatch.setattr(llama_cpp, "smoke_test", crash)
    with pytest.raises(llama_cpp.LlamaCppError, match="SIGSEGV"):
        llama_cpp._install(tmp_path / "b" / "bin", src, root)
    assert list(root.parent.iterdir()) == []


def test_llama_cpp_server_is_gone_after_an_interrupted_start(tmp_path, monkeypatch):
    """A server starts in a session of its own (Ctrl-C in the terminal does not reach it), so any exception
    while it starts, KeyboardInterrupt included, must end it: none outlives its caller."""
    import sys

    class Sleeper(llama_cpp.ServerProcess):
        cmd, timeout, port = [sys.executable, "-c", "import time; time.sleep(120)"], 60, llama_cpp.free_port()

    calls = []

    def interrupted(*a, **k):  # the health check is where a start waits; Ctrl-C arrives there
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(llama_cpp.urllib.request, "urlopen", interrupted)
    server = Sleeper()
    with pytest.raises(KeyboardInterrupt):
        server.__enter__()
    assert calls and server.proc.poll() is not None  # ended, not left running


def test_llama_cpp_converter_names_the_missing_extra(tmp_path):
    """A converter run that fails on a missing import says which package and which extra installs it, not only
    that the command failed."""
    import sys

    with pytest.raises(llama_cpp.LlamaCppError, match="'sentencepiece'.*eaglekit\\[llama-cpp\\]"):
        llama_cpp._run([sys.executable, "-c", "raise ModuleNotFoundError(\"No module named 'sentencepiece'\")"],
                       "convert_hf_to_gguf.py x")


def fake_build(root):
    """The binaries of a build in ``root``, executable (its stamp is the caller's)."""
    (root / "bin").mkdir(parents=True)
    for b in llama_cpp.BINARIES:
        (root / "bin" / b).write_text("#!/bin/sh\n")
        (root / "bin" / b).chmod(0o755)


def test_llama_cpp_build_cache_is_stamped_with_this_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEKIT_CACHE", str(tmp_path))
    root = llama_cpp.install_dir()
    assert root.parent == tmp_path and llama_cpp.installed() is None
    fake_build(root)
    (root / ".built").write_text(llama_cpp._stamp().replace("cpu=", "cpu=other"))  # built on another CPU
    assert llama_cpp.installed() is None
    (root / ".built").write_text(llama_cpp._stamp() + "\n")
    assert llama_cpp.installed() == root
    (root / "bin" / "llama-quantize").unlink()  # half a build is no build
    assert llama_cpp.installed() is None
    with pytest.raises(llama_cpp.LlamaCppError, match="scripts/llama_cpp.sh"):
        llama_cpp.require(build_if_missing=False)


def test_llama_cpp_build_waits_for_a_build_under_way_instead_of_building_twice(tmp_path, monkeypatch):
    """scripts/test.sh starts the build beside setup; a test needing it meanwhile waits on the build's lock,
    then finds the finished build (fileio.held: a flock, so a build that died frees it)."""
    import threading
    import time

    from eaglekit.fileio import held

    monkeypatch.setenv("EAGLEKIT_CACHE", str(tmp_path))
    root = llama_cpp.install_dir()
    built = []
    monkeypatch.setattr(llama_cpp, "_build", lambda jobs, log: built.append(1) or root)
    found = []
    with held(tmp_path / f".{root.name}.lock"):  # the other process's build, under way
        waiting = threading.Thread(target=lambda: found.append(llama_cpp.build()))
        waiting.start()
        time.sleep(0.5)
        assert waiting.is_alive() and not found
        fake_build(root)  # it finishes
        (root / ".built").write_text(llama_cpp._stamp() + "\n")
    waiting.join(10)
    assert found == [root] and not built  # found, not built again
    (root / ".built").unlink()
    assert llama_cpp.build() == root and built == [1]  # with no build under way and none there, it builds


def test_llama_cpp_completion_counts_steps_as_eaglekit_does():
    c = llama_cpp.Completion(tokens=list(range(17)), timings={"draft_n": 24, "draft_n_accepted": 8})
    assert c.steps == 8 and c.tau == 2.0  # 16 tokens after the prefill's, 8 of them accepted drafts


@pytest.fixture(scope="module")
def served(smollm2):
    """(llama.cpp root, the embedded Q4_1 SmolLM2 file, 4 MT-bench prompts, plain llama-server's 40 greedy
    tokens for each, conversations of those answers to fit heads to)."""
    root = llama_cpp.require(build_if_missing=True)
    model = assets.asset_file("smollm2-135m-instruct")  # the embedded Q4_1 file the PyTorch path dequantises
    questions = [q["turns"][0] for q in assets.load_mt_bench()[:4]]
    prompts = [smollm2.chat_ids(q)[0].tolist() for q in questions]
    with llama_cpp.Server(model, root=root, threads=SERVER_THREADS) as plain:
        refs = [plain.complete(ids, 40).tokens for ids in prompts]
    assert all(len(r) >= 8 for r in refs)
    convs = [{"id": str(i), "messages": [{"role": "user", "content": q},
                                         {"role": "assistant", "content": smollm2.tokenizer.decode(r)}]}
             for i, (q, r) in enumerate(zip(questions, refs))]
    return root, model, prompts, refs, convs


@pytest.mark.parametrize("kind", ["dflash2", "dspark", "eagle3"])
def test_head_drafts_from_each_output_anchor_as_a_fresh_draft_does(target, kind):
    """``head_drafts`` feeds a parallel head the prompt's context in one call, then one element at a time: each
    output anchor's row is what a fresh cache fed the whole prefix drafts (an EAGLE head's rows come from one
    unroll); rows inside the prompt, which no server drafts from, hold -1 / 0."""
    torch.manual_seed(0)
    opts = {"dflash2": {"selector_top_k": 4, "block_size": 4}, "dspark": {"block_size": 4}, "eagle3": {}}[kind]
    head = build_head(HeadConfig.from_target(target, kind=kind, **opts), target)
    prompt, tokens = torch.randint(0, 64, (9,)).tolist(), torch.randint(0, 64, (5,)).tolist()
    drafts, probs = head_drafts(target, head, prompt, tokens, 3)
    assert drafts.shape == (14, 3) and (drafts[:8] == -1).all() and (probs[:8] == 0).all()
    seq = torch.tensor([prompt + tokens])
    g = head.fuse(target.forward(seq, layer_ids=head.taps, logits=False).taps)
    if kind == "eagle3":  # the TTT unroll over the whole sequence: every anchor's chain at once
        from eaglekit.heads.objectives import ttt_unroll
        unrolled = torch.stack([lg[0] for _, _, lg in ttt_unroll(head, seq, g, 3)], 1)  # [S, 3, Vd]
    for t in range(8, 13):
        if kind == "eagle3":
            want = unrolled[t]
        else:  # a fresh cache fed the whole prefix, then one block
            want = head.draft(head.new_cache(), seq[:, 1:t + 2], g[:, :t + 1], torch.arange(t + 1)[None])[0, :3]
        top = want.float().topk(10, dim=-1)
        assert drafts[t].tolist() == (top.indices[:, 0] + head.d2t[top.indices[:, 0]]).tolist(), t
        torch.testing.assert_close(probs[t], top.values.softmax(-1)[:, 0], rtol=1e-4, atol=1e-5)


@pytest.mark.real
@pytest.mark.slow  # ~1 min with a built llama.cpp (a few minutes more the first time: it is built)
def test_llama_cpp_real_server_drafts_with_an_exported_head(smollm2, served, tmp_path):
    root, model, prompts, refs, convs = served
    n = 40
    # a head fitted to llama-server's own answers, as llama.cpp can serve it (one norm over the taps)
    trained = fit_head(smollm2, convs, tmp_path / "fit", "head.fc_norm=false", "head.norm_output=false",
                       "head.norm_before_fc=true", "head.init_from_target=true", "optim.epochs=20")
    from eaglekit.export import load_head

    torch.manual_seed(0)
    heads = {"trained": load_head(trained, smollm2),
             "random": build_head(HeadConfig.from_target(smollm2, kind="eagle3", draft_vocab_size=1024), smollm2)}
    rates = {}
    for name, head in heads.items():
        gguf = export_head(head, tmp_path / name, "llama.cpp", gguf_type="f16")
        assert gguf.name == "head-f16.gguf" and gguf.stat().st_size > 0
        assert not [p for p in gguf.parent.iterdir() if p.name.endswith(".tmp")]
        with llama_cpp.Server(model, draft=gguf, spec_type="draft-eagle3", n_max=3, root=root,
                              threads=SERVER_THREADS) as s:
            outs = [s.complete(ids, n) for ids in prompts]
        for i, (ref, out) in enumerate(zip(refs, outs)):
            assert out.tokens == ref, f"{name} head, prompt {i}: output differs from plain llama-server"
        drafted = sum(o.draft_n for o in outs)
        rates[name] = sum(o.accepted for o in outs) / max(drafted, 1)
        assert drafted > 0, f"{name}: llama-server drafted nothing"
        if name == "trained":  # eaglekit's head replayed on the server's own outputs accepts as much
            reps = [replay(ids + o.tokens, len(ids), *head_drafts(smollm2, head, ids, o.tokens, 3), n_max=3)
                    for ids, o in zip(prompts, outs)]
            tau_ours = sum(len(o.tokens) - 1 for o in outs) / sum(r["steps"] for r in reps)
            tau_server = sum(len(o.tokens) - 1 for o in outs) / sum(o.steps for o in outs)
            assert abs(tau_server - tau_ours) <= 0.05 * tau_ours, (tau_server, tau_ours)
    assert rates["trained"] > 0.15 and rates["random"] < 0.02, rates


def serve_like_plain_and_replay(target, head, served, tmp_path, spec_type: str, n_max: int = 3):
    """``head`` exported with ``--to llama.cpp`` and served with ``spec_type`` on the ``served`` fixture's prompts
    (40 tokens each): every output equal to plain llama-server's. Returns (the server's completions, eaglekit's
    replay of the same head's drafts on those outputs)."""
    root, model, prompts, refs, _ = served
    gguf = export_head(head, tmp_path / "gguf", "llama.cpp", gguf_type="f16")
    with llama_cpp.Server(model, draft=gguf, spec_type=spec_type, n_max=n_max, root=root,
                          threads=SERVER_THREADS) as s:
        outs = [s.complete(ids, 40) for ids in prompts]
    for i, (ref, out) in enumerate(zip(refs, outs)):
        assert out.tokens == ref, f"{head.config.kind} head, prompt {i}: output differs from plain llama-server"
    reps = [replay(ids + o.tokens, len(ids), *head_drafts(target, head, ids, o.tokens, n_max), n_max=n_max)
            for ids, o in zip(prompts, outs)]
    return outs, reps


@pytest.mark.real
@pytest.mark.slow  # ~40 s with a built llama.cpp
def test_llama_cpp_real_server_drafts_with_an_exported_dspark_head(smollm2, served, tmp_path):
    """A DSpark head (block of 4, its previous-token bias chained through the block) exported with
    ``--to llama.cpp`` (speculators' dspark layout, then llama.cpp's converter) and served with
    ``--spec-type draft-dspark``: greedy output identical to plain llama-server, and what the server accepts
    is what eaglekit's own drafting of the same head accepts on those outputs (within 5%: f16 weights and
    llama.cpp's arithmetic may flip a near tie; on 2026-12-03 they were equal prompt by prompt)."""
    from eaglekit.export import load_head

    convs = served[4]
    fitted = fit_head(smollm2, convs, tmp_path / "fit", "head.kind=dspark", "head.block_size=4", "head.num_layers=1",
                      "head.markov_rank=64", "head.init_from_target=true", "optim.epochs=20")
    head = load_head(fitted, smollm2)
    assert head.config.kind == "dspark" and float(head.markov_w2.weight.abs().max()) > 0  # the bias trained
    outs, reps = serve_like_plain_and_replay(smollm2, head, served, tmp_path, "draft-dspark")
    server, ours = sum(o.accepted for o in outs), sum(r["accepted"] for r in reps)
    assert abs(server - ours) <= 0.05 * ours, ([o.accepted for o in outs], [r["accepted"] for r in reps])
    assert sum(o.accepted for o in outs) / sum(o.draft_n for o in outs) > 0.15


@pytest.mark.real
@pytest.mark.slow  # ~1.5 min with a built llama.cpp
def test_llama_cpp_real_server_drafts_for_a_qwen2_target(qwen05, tmp_path):
    """Qwen2.5-Coder-0.5B (the embedded GGUF, a qwen2 graph): eaglekit's build records its layer inputs, so an
    EAGLE-3 head fitted to llama-server's own answers to 3 HumanEval prompts drafts there with output identical
    to plain llama-server and drafts accepted; the same file relabelled as llama (``eaglekit relabel``, what a
    stock llama-server needs) gives the same tokens under the same build with the head (plain, its logits are
    the original's: tests/engines/test_gguf_relabel.py). Same tokens
    means: identical, or leaving plain's path only where plain's top two tokens are a near-tie (the relabelled
    graph rotates pairs instead of halves and adds biases in another order: the same arithmetic rounded
    otherwise; on the AVX2 EPYC of 2026-12-05 one answer left at its 4th token, gap 0.076)."""
    from eaglekit.engines.gguf_relabel import relabel_qwen2_as_llama
    from eaglekit.export import load_head

    root = llama_cpp.require()
    model = assets.asset_file("qwen2.5-coder-0.5b-instruct")
    questions = [q["prompt"] for q in assets.load_humaneval()[:3]]
    prompts = [qwen05.chat_ids(f"Complete this function:\n{q}")[0].tolist() for q in questions]
    n = 32
    with llama_cpp.Server(model, root=root, threads=SERVER_THREADS) as plain:
        plain_outs = [plain.complete(ids, n, n_probs=2) for ids in prompts]
    refs = [o.tokens for o in plain_outs]

    def same_tokens(name, outs):  # identical, or leaving plain's path only at a near-tie (reported)
        for i, (ref, out) in enumerate(zip(plain_outs, outs)):
            if (d := first_diff(out, ref.tokens)) is not None:
                gap = top2_gap(ref, d)
                print(f"{name}: prompt {i} leaves plain's path at token {d}, plain's top-2 log-prob gap {gap}")
                assert gap is not None and gap < NEAR_TIE, f"{name}: prompt {i} differs from plain at {d} (gap {gap})"

    convs = [{"id": str(i), "messages": [{"role": "user", "content": f"Complete this function:\n{q}"},
                                         {"role": "assistant", "content": qwen05.tokenizer.decode(r)}]}
             for i, (q, r) in enumerate(zip(questions, refs))]
    fitted = fit_head(qwen05, convs, tmp_path / "fit", "head.fc_norm=false", "head.norm_output=false",
                      "head.norm_before_fc=true", "head.init_from_target=true", "optim.epochs=20",
                      # HumanEval prompts are long: the answers must fit; Qwen's taps diverge at 3e-3
                      "data.max_length=768", "optim.lr=1e-3")
    head = load_head(fitted, qwen05)
    gguf = export_head(head, tmp_path / "head", "llama.cpp", gguf_type="f16")
    relabelled = relabel_qwen2_as_llama(model, tmp_path / "qwen-as-llama.gguf")
    outs = {}
    for name, target in (("qwen2", model), ("llama", relabelled)):
        with llama_cpp.Server(target, draft=gguf, spec_type="draft-eagle3", n_max=3, root=root,
                              threads=SERVER_THREADS) as s:
            outs[name] = [s.complete(ids, n) for ids in prompts]
    for name, out in outs.items():
        same_tokens(f"{name}, drafted", [o.tokens for o in out])
        drafted, accepted = sum(o.draft_n for o in out), sum(o.accepted for o in out)
        print(f"{name}, drafted: {accepted} of {drafted} drafted tokens accepted")
        assert drafted > 0 and accepted / drafted > 0.3, (name, drafted, accepted)
    # the server accepts what eaglekit's drafting of the same head accepts on the server's own outputs
    reps = [replay(ids + o.tokens, len(ids), *head_drafts(qwen05, head, ids, o.tokens, 3), n_max=3)
            for ids, o in zip(prompts, outs["qwen2"])]
    server, ours = sum(o.accepted for o in outs["qwen2"]), sum(r["accepted"] for r in reps)
    assert abs(server - ours) <= 0.05 * ours, ([o.accepted for o in outs["qwen2"]], [r["accepted"] for r in reps])


def test_llama_cpp_converts_qwen35_checkpoints_without_mtp_tensors_with_no_mtp(tmp_path, monkeypatch):
    """The pinned converter's Qwen3-Next / Qwen3.5 classes add MTP layers unless told --no-mtp (their assert, or
    nextn layers llama-server cannot load, for a checkpoint holding none: transformers' save_pretrained drops
    them). ``convert`` passes --no-mtp exactly for a checkpoint of those architectures without an mtp.* tensor,
    read from its safetensors headers or its shards' index; any other architecture never gets it (the
    converter exits on the flag for a class without MTP export)."""
    import json

    from safetensors.torch import save_file

    def folder(name, arch, tensors=(), index=()):
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"architectures": [arch], "mtp_num_hidden_layers": 1}))
        if tensors:
            save_file({t: torch.zeros(1) for t in tensors}, str(path / "model.safetensors"))
        if index:
            (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(index, "a")}))
        return path

    cmds = []
    monkeypatch.setattr(llama_cpp, "_run", lambda cmd, what, log=None, env=None: cmds.append(cmd))
    cases = {folder("stripped", "Qwen3_5ForCausalLM", ["model.embed_tokens.weight"]): True,
             folder("sharded", "Qwen3_5MoeForConditionalGeneration", index=["model.norm.weight"]): True,
             folder("with-mtp", "Qwen3_5ForCausalLM", ["model.norm.weight", "mtp.fc.weight"]): False,
             folder("next", "Qwen3NextForCausalLM", index=["model.norm.weight", "mtp.layers.0.mlp.up.weight"]): False,
             folder("unread", "Qwen3_5ForCausalLM"): False,  # no safetensors: the converter decides alone
             folder("llama", "LlamaForCausalLM", ["model.norm.weight"]): False}
    for path, no_mtp in cases.items():
        assert llama_cpp.lacks_mtp(path) == no_mtp, path.name
        llama_cpp.convert(path, tmp_path / f"{path.name}.gguf", "f32", root=tmp_path)
        assert ("--no-mtp" in cmds[-1]) == no_mtp, (path.name, cmds[-1])


def tiny_qwen35(path, tokenizer_dir, seed: int = 0):
    """A random Qwen3.5 text model (3 Gated DeltaNet layers, then full attention; 64 wide) with the tokenizer in
    ``tokenizer_dir``, saved to ``path`` as transformers saves it (no MTP tensors). head_dim 256: the converter
    writes Qwen3.5's mrope sections [11, 11, 10, 0], 64 rotary dims = 256 * partial_rotary_factor 0.25. Its
    matrices are drawn at std 0.1 (not the init's 0.02: greedy decoding does not settle into a loop) and the
    lm_head rows of 6 tokens scaled by 30: its greedy answers are mostly those 6, so a token does not tell which
    follows, and a head must read the target's features to draft them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3_5TextConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=2, num_key_value_heads=1,
        head_dim=256, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
        model.lm_head.weight[1000:1006] *= 30
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def memorise(target, head, seqs: list[tuple[list[int], list[int]]], steps: int = 100) -> None:
    """Fit ``head`` to chain-draft (3 TTT steps) the target's greedy answers ``seqs`` ((prompt, answer) pairs):
    its draft vocabulary their tokens (then the lowest other ids), cross-entropy on the answers' tokens, AdamW.
    Memorised with clear margins (20% noise on the features changes 4 of 588 drafts and no accepted one), so f32
    llama.cpp and eaglekit draft alike, and the features matter: the taps read as [0, 1, 2] in place of [1, 2, 3]
    cut eaglekit's τ on tiny_qwen35's answers from 3.92 to 3.42 (as [1, 2, 2]: 3.69)."""
    from eaglekit.heads.objectives import ttt_unroll

    vd, vocab = head.config.draft_vocab_size, target.vocab_size
    used = {t for p, a in seqs for t in p + a}
    ids = torch.tensor(sorted([*used, *[t for t in range(vd + len(used)) if t not in used][:vd - len(used)]]))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    head.set_draft_vocab(ids - torch.arange(vd), t2d)
    head.init_from_target(target)
    to_draft = torch.full((vocab,), -100, dtype=torch.long)
    to_draft[ids] = torch.arange(vd)
    batches = []
    with torch.no_grad():
        for p, a in seqs:
            seq = torch.tensor([p + a])
            batches.append((seq, target.forward(seq, layer_ids=head.taps, logits=False).taps))
    opt = torch.optim.AdamW([w for w in head.parameters() if w.requires_grad], lr=3e-3)
    for _ in range(steps):
        for seq, taps in batches:
            loss = sum(torch.nn.functional.cross_entropy(logits[0, :seq.shape[1] - 2 - k], to_draft[seq[0, 2 + k:]])
                       for k, _, logits in ttt_unroll(head, seq, head.fuse(taps), 3))  # step k: token t + 2 + k
            opt.zero_grad()
            loss.backward()
            opt.step()
    head.eval()


@pytest.mark.real
@pytest.mark.slow  # ~30 s with a built llama.cpp
def test_llama_cpp_real_server_drafts_for_a_qwen35_target(tmp_path):
    """A tiny random Qwen3.5 (hybrid: Gated DeltaNet and full attention; Qwen2.5-Coder's tokenizer) with an MTP
    layer eaglekit trained from scratch (``fit_mtp`` on its greedy answers) and wrote back in Qwen's layout
    (``write_checkpoint``: mtp.*), converted by ``convert`` to an f32 GGUF (its MTP layer kept): plain llama-server
    decodes what transformers does greedily. With an EAGLE-3 head memorised on those answers (``memorise``) and a
    DFlash head (``memorise_block``), each exported for llama.cpp, and with the GGUF's own MTP layer (``--spec-type
    draft-mtp``), llama-server's output is plain's and so is eaglekit's chain decoding with the same drafter (depth 3;
    llama.cpp takes each DFlash slot's argmax), and τ of the two agree within 3% (on 2026-12-06: EAGLE-3 3.720 both
    sides; DFlash steps per prompt [10, 11, 12] both sides, 60 of 93 drafts accepted; MTP [11, 13, 12] both sides,
    57 of 103 accepted)."""
    from eaglekit import decode
    from eaglekit.decode.drafters import TreeSpec
    from eaglekit.export.mtp_checkpoint import write_checkpoint
    from eaglekit.target import load_target

    root = llama_cpp.require()
    folder = tiny_qwen35(tmp_path / "qwen35", assets.model_dir("qwen2.5-coder-0.5b-instruct"))
    target = load_target(str(folder))
    texts = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n"]
    prompts = [target.tokenizer(t)["input_ids"] for t in texts]
    n = 32
    refs = [hf_greedy(target, ids, n)[0, len(ids):].tolist() for ids in prompts]
    mtp = build_head(HeadConfig.from_target(target, kind="mtp"), target)
    fit_mtp(mtp, target, [ids + ref for ids, ref in zip(prompts, refs)], steps=40)
    model = llama_cpp.convert(write_checkpoint(mtp.eval(), target, tmp_path / "with-mtp"), tmp_path / "qwen35.gguf",
                              "f32", root=root)
    with llama_cpp.Server(model, root=root, threads=SERVER_THREADS) as plain:
        for i, (ids, ref) in enumerate(zip(prompts, refs)):
            assert plain.complete(ids, n).tokens == ref, f"prompt {i}: llama-server != transformers"

    torch.manual_seed(0)
    head = build_head(HeadConfig.from_target(target, kind="eagle3", draft_vocab_size=1024, norm_before_fc=True,
                                             aux_layer_ids=[1, 2, 3]), target)
    memorise(target, head, list(zip(prompts, refs)), steps=60)
    gguf = export_head(head, tmp_path / "head", "llama.cpp", gguf_type="f32", target_dir=folder)
    torch.manual_seed(0)  # DFlash: llama.cpp reads the full vocabulary and distinct taps
    dflash = build_head(HeadConfig.from_target(target, kind="dflash", block_size=4, num_layers=1,
                                               draft_vocab_size=target.vocab_size, aux_layer_ids=[1, 2, 3]), target)
    memorise_block(target, dflash, list(zip(prompts, refs)), steps=20)
    dflash_gguf = export_head(dflash, tmp_path / "dflash", "llama.cpp", gguf_type="f32", target_dir=folder)
    chain = TreeSpec(depth=3, top_k=1, total_tokens=3)
    for name, drafter, server in (("eagle3", head, {"draft": gguf, "spec_type": "draft-eagle3"}),
                                  ("dflash", dflash, {"draft": dflash_gguf, "spec_type": "draft-dflash"}),
                                  ("mtp", mtp, {"spec_type": "draft-mtp"})):
        with llama_cpp.Server(model, n_max=3, root=root, threads=SERVER_THREADS, **server) as s:
            outs = [s.complete(ids, n) for ids in prompts]
        ours = [decode.generate(target, drafter, torch.tensor([ids]), n, tree=chain, eos_token_id=False)
                for ids in prompts]
        same_chain(f"qwen35 {name}", prompts, refs, outs, ours)


def memorise_block(target, head, seqs: list[tuple[list[int], list[int]]], steps: int) -> None:
    """Fit a parallel (block) head to the target's greedy answers ``seqs`` ((prompt, answer) pairs) through its own
    training objective (``head.training_loss`` in ``TTTModel``, the trainer's default loss settings), AdamW, one
    sequence per step."""
    from eaglekit.heads.objectives import Teacher, TTTModel
    from eaglekit.train.config import LossConfig

    head.init_from_target(target)
    model = TTTModel(head, Teacher.build(target.lm_head.weight, head.t2d), LossConfig())
    data = []
    with torch.no_grad():
        for p, a in seqs:
            seq = torch.tensor([p + a])
            out = target.forward(seq, layer_ids=head.taps, logits=False)
            mask = torch.zeros_like(seq)
            mask[0, len(p):] = 1  # the answer is supervised
            data.append((seq, mask, out.last, out.taps))
    opt = torch.optim.AdamW([w for w in head.parameters() if w.requires_grad], lr=3e-3)
    head.train()
    for _ in range(steps):
        for seq, mask, last, taps in data:
            loss, _ = model(seq, mask, last, taps, steps=3)
            opt.zero_grad()
            (loss / mask.sum()).backward()
            opt.step()
    head.eval()


def same_chain(name, prompts, refs, outs, ours) -> None:
    """llama-server's outputs with a drafter (``outs``) and eaglekit's chain decoding with the same one (``ours``):
    both the reference tokens; τ (tokens per verify forward) within 3%; drafts partly accepted."""
    for i, (ids, ref, out) in enumerate(zip(prompts, refs, outs)):
        assert out.tokens == ref, f"{name}, prompt {i}: llama-server with the drafter differs from plain"
        assert ours[i].sequences[0, len(ids):].tolist() == ref, f"{name}, prompt {i}: eaglekit's chain differs"
    steps = ([o.steps for o in outs], [len(o.stats.accept_lengths) for o in ours])  # verify forwards per prompt
    tau_server, tau_ours = (sum(len(o.tokens) - 1 for o in outs) / sum(s) for s in steps)
    drafted, accepted = sum(o.draft_n for o in outs), sum(o.accepted for o in outs)
    print(f"{name}: tau llama-server {tau_server:.3f}, eaglekit {tau_ours:.3f}; steps per prompt {steps}; "
          f"llama-server accepted {accepted} of {drafted} drafts")
    assert abs(tau_server - tau_ours) <= 0.03 * tau_ours, (name, steps)
    assert tau_server > 1.5 and 0.3 < accepted / drafted < 1, (name, tau_server, accepted, drafted)


def tiny_glm45_mtp(path, tokenizer_dir):
    """A random GLM-4.5 (arch_matrix's glm4_moe: 64 wide, 2 layers, the second MoE) shipping one MTP layer as GLM-4.5
    does: layer 2 of a 3-layer model plus enorm / hnorm / eh_proj / shared_head (norm, head) and an embed_tokens
    copy under ``model.layers.2.``; config num_hidden_layers 2, num_nextn_predict_layers 1 (the ``shipped`` fixture
    of tests/heads/test_heads_mtp.py). Qwen2.5-Coder's tokenizer with the 3 tokens llama.cpp's GLM-4.5 vocabulary
    needs ([gMASK], <|user|>, <|observation|>), vocabulary 152064: the pinned converter keeps GLM-4.5's MTP layer
    as the GGUF's ``blk.2.nextn.*`` tensors (DeepSeek-V3's it drops), which ``--spec-type draft-mtp`` drafts with."""
    import transformers
    from arch_matrix import MATRIX, config

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": ["[gMASK]", "<|user|>", "<|observation|>"]})
    arch = MATRIX["glm4_moe"]
    cfg = config(arch)
    cfg.num_hidden_layers, cfg.vocab_size, cfg.architectures = 3, 152064, [arch.model_class]
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, None
    nextn_checkpoint(path, cfg, tok)
    return path


@pytest.mark.real
@pytest.mark.slow  # ~20 s with a built llama.cpp
def test_llama_cpp_real_server_drafts_with_an_exported_mtp_layer(tmp_path):
    """A tiny random GLM-4.5 shipping an MTP layer (``tiny_glm45_mtp``): its layer loaded by eaglekit
    (``shipped_head``), fitted a little on the target's 32-token greedy answers (``fit_mtp``, 8 steps: drafts partly
    accepted), written back into a copy of the checkpoint (``write_checkpoint``) and converted by ``convert`` to an
    f32 GGUF. Plain llama-server decodes what transformers does greedily; with ``--spec-type draft-mtp`` (the GGUF's
    own nextn layer, depth 3) its output is plain's and so is eaglekit's chain decoding with the head, and τ of the
    two agree within 3% (on 2026-12-06 both 2.906, steps per prompt [10, 12, 10] on both sides; 61 of 88 drafts
    accepted by llama-server)."""
    from eaglekit import decode
    from eaglekit.decode.drafters import TreeSpec
    from eaglekit.export.mtp_checkpoint import write_checkpoint
    from eaglekit.heads.mtp import shipped_head
    from eaglekit.target import load_target

    root = llama_cpp.require()
    folder = tiny_glm45_mtp(tmp_path / "glm45", assets.model_dir("qwen2.5-coder-0.5b-instruct"))
    target = load_target(str(folder))
    texts = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n"]
    prompts = [target.tokenizer(t)["input_ids"] for t in texts]
    n = 32
    refs = [hf_greedy(target, ids, n)[0, len(ids):].tolist() for ids in prompts]
    head = shipped_head(target)
    fit_mtp(head, target, [ids + ref for ids, ref in zip(prompts, refs)], steps=8)
    head.eval()
    model = llama_cpp.convert(write_checkpoint(head, target, tmp_path / "fitted"), tmp_path / "glm45-f32.gguf", "f32",
                              root=root)
    with llama_cpp.Server(model, root=root, threads=SERVER_THREADS) as plain:
        plains = [plain.complete(ids, n).tokens for ids in prompts]
    with llama_cpp.Server(model, spec_type="draft-mtp", n_max=3, root=root, threads=SERVER_THREADS) as s:
        outs = [s.complete(ids, n) for ids in prompts]
    chain = TreeSpec(depth=3, top_k=1, total_tokens=3)
    ours = [decode.generate(target, head, torch.tensor([ids]), n, tree=chain, eos_token_id=False) for ids in prompts]
    assert plains == refs, "llama-server != transformers"
    same_chain("glm45 mtp", prompts, refs, outs, ours)

def test_llama_cpp_bench_gives_an_ngram_configuration_a_fresh_server_each_repeat(monkeypatch):
    """llama.cpp's n-gram stores learn from every answer their server gave: a configuration with an n-gram type
    gets a new server before each repeat (else the second repeat drafts the benched answers from memory); the
    others keep theirs. Every server is closed at the end."""
    from types import SimpleNamespace

    from eaglekit.bench.llama_cpp import measure

    started, closed = [], []

    class Fake:
        def __init__(self, model, root=None, threads=None, **kw):
            self.spec = kw.get("spec_type")

        def __enter__(self):
            started.append(self.spec)
            return self

        def complete(self, ids, n_predict):
            return llama_cpp.Completion([1] * n_predict, {"predicted_n": n_predict, "predicted_ms": 1.0})

        def close(self):
            closed.append(self.spec)

    monkeypatch.setattr(llama_cpp, "Server", Fake)
    confs = {"plain": {}, "head": {"spec_type": "draft-eagle3"}, "ngram-mod": {"spec_type": "ngram-mod"},
             "head+ngram-mod": {"spec_type": "draft-eagle3,ngram-mod"}}
    runs = measure(SimpleNamespace(repeats=3, max_new_tokens=4), None, "m.gguf", confs, [[1, 2], [3, 4]], None, 2)
    assert sorted(started, key=str) == sorted([None, "draft-eagle3", *["ngram-mod"] * 3,
                                               *["draft-eagle3,ngram-mod"] * 3], key=str)
    assert sorted(closed, key=str) == sorted(started, key=str)
    assert all(len(reps) == 3 and all(len(rep) == 2 for rep in reps) for reps in runs.values())


def test_llama_cpp_bench_reports_where_an_output_leaves_plain_and_how_near_a_tie():
    """A configuration whose output differs from plain llama-server's is reported with the first differing
    position and plain's top-2 log-probability gap there (a near-tie is llama.cpp's rounding, not a bug)."""
    from eaglekit.bench.llama_cpp import summarise

    timings = {"predicted_n": 4, "predicted_ms": 100.0}
    top = [{5: -0.1, 6: -3.0}, {7: -0.69, 8: -0.70}, {9: -0.2, 1: -2.2}, {2: -0.01, 3: -5.0}]
    refs = [llama_cpp.Completion([5, 7, 9, 2], timings, top), llama_cpp.Completion([5, 7, 9, 2], timings, top)]
    other = [llama_cpp.Completion([5, 7, 9, 2], timings), llama_cpp.Completion([5, 8, 1, 1], timings)]
    report = summarise({"plain": [refs], "head": [other]}, refs)["results"]
    assert report["plain"]["divergences"] == [] and report["head"]["identical_to_plain"] == "1/2"
    (d,) = report["head"]["divergences"]
    assert d["prompt"] == 1 and d["position"] == 1 and d["plain_top2_logprob_gap"] == pytest.approx(0.01)


def test_vllm_server_interrupted_at_start_leaves_no_process_and_no_folder(tmp_path, monkeypatch):
    """`vllm serve` of a folder eaglekit dequantised from GGUF goes through a temporary copy without its
    quantization block; Ctrl-C while the server starts ends the server and removes that copy too."""
    import json
    import sys
    import tempfile

    from eaglekit.engines import vllm_cpu

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gguf"}}))
    (model / "model.safetensors").write_text("weights")
    root = tmp_path / "venv"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "vllm").write_text(f"#!{sys.executable}\nimport time\ntime.sleep(120)\n")
    (root / "bin" / "vllm").chmod(0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(llama_cpp.urllib.request, "urlopen", interrupted)
    server = vllm_cpu.Server(model, root=root)
    with pytest.raises(KeyboardInterrupt):
        server.__enter__()
    assert server.proc.poll() is not None  # the server process ended
    assert not [p for p in (tmp_path / "tmp").iterdir() if p.name.startswith("eaglekit-plain-")]  # nor the copy


def test_llama_cpp_server_dies_with_the_process_that_started_it(tmp_path):
    """A caller killed with SIGKILL runs no cleanup; the server, in a session of its own, still ends with it."""
    import os
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "server.pid"
    script = f"""
import os, signal, sys
from eaglekit.engines import llama_cpp
class Sleeper(llama_cpp.ServerProcess):
    cmd, timeout, port = [sys.executable, "-c", "import time; time.sleep(120)"], 60, llama_cpp.free_port()
s = Sleeper()
llama_cpp.ServerProcess._wait_healthy = lambda self: None
s.__enter__()
open({str(pid_file)!r}, "w").write(str(s.proc.pid))
os.kill(os.getpid(), signal.SIGKILL)
"""
    caller = subprocess.run([sys.executable, "-c", script], check=False, timeout=60)
    assert caller.returncode == -9
    pid = int(pid_file.read_text())
    for _ in range(100):  # the kernel sends SIGTERM at once; give it a moment to be reaped
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().split()[2] == "Z":  # ended, not yet reaped
                break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        raise AssertionError("the server outlived its caller")
