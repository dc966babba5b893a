"""eaglekit.llama_cpp: what llama.cpp can serve (refused before anything is written, naming the config keys
that train a servable head), the build cache's stamp, and — slow, real — a head exported with
``export_head(..., "llama.cpp")`` drafting in a real llama-server on the embedded Q4_1 SmolLM2 file: greedy
output identical to plain llama-server, drafts accepted for a trained head and not for a random one.

The slow test builds the pinned llama.cpp the first time (~4-6 min on 2 cores, cached in
~/.cache/eaglekit/llama.cpp-0.3.36; `bash scripts/llama_cpp.sh` does it ahead), then takes ~1 min."""
import pytest
import torch
from helpers import SERVER_THREADS, fit_head, save_tiny, tiny_target

from eaglekit import assets, llama_cpp
from eaglekit.bench.llama_cpp import head_drafts, replay
from eaglekit.export import export_head
from eaglekit.export.formats import ExportError
from eaglekit.heads import HeadConfig, build_head

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_target(layers=12, hidden=32, vocab_size=64)


@pytest.mark.parametrize("kind,flags,named", [
    ("eagle3", {"fc_norm": True}, "head.fc_norm=true"),
    ("eagle3", {"norm_output": True}, "head.norm_output=true"),
    ("eagle3", {"num_layers": 2}, "head.num_layers=2"),
    ("eagle3", {"aux_layer_ids": [1, 4, 7, 9]}, "taps [1, 4, 7, 9]"),
    ("peagle", {}, "this is a peagle head"),
    ("dflash", {}, "this is a dflash head"),
    ("dspark", {"aux_layer_ids": [0, 4, 7]}, "taps [0, 4, 7]"),
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


def test_llama_cpp_serves_plain_and_norm_before_fc_heads(target, tmp_path):
    for flags in ({}, {"norm_before_fc": True}, {"norm_before_residual": True}):
        assert llama_cpp.refusal(HeadConfig.from_target(target, kind="eagle3", **flags)) is None
    head = build_head(HeadConfig.from_target(target, kind="eagle3"), target)
    folder = save_tiny(tmp_path / "tiny")
    with pytest.raises(llama_cpp.LlamaCppError, match="gguf type 'q4_0'"):
        export_head(head, tmp_path / "out", "llama.cpp", target_dir=folder, gguf_type="q4_0")
    with pytest.raises(llama_cpp.LlamaCppError, match="no config.json|none there"):
        export_head(head, tmp_path / "out", "llama.cpp", target_dir=tmp_path, gguf_type="f16")
    assert not (tmp_path / "out" / "head-q4_0.gguf").exists()


def test_llama_cpp_refuses_a_target_whose_graph_records_no_layer_inputs(target, tmp_path):
    """The pinned llama.cpp's Qwen2 graph records no layer inputs, so llama-server aborts on the first batch
    of an EAGLE-3 or DSpark draft for a Qwen2 / Qwen2.5 target: refused at export (the target's folder) and
    before a server starts (the target GGUF's architecture), naming what it can serve."""
    import gguf

    head = build_head(HeadConfig.from_target(target, kind="eagle3"), target)
    qwen = save_tiny(tmp_path / "qwen2", arch="qwen2")
    with pytest.raises(ExportError, match="qwen2 target .*layer input tensor is null.*llama, mistral, qwen3"):
        export_head(head, tmp_path / "out", "llama.cpp", target_dir=qwen, gguf_type="f16")
    assert not (tmp_path / "out").exists()
    assert llama_cpp.target_refusal(save_tiny(tmp_path / "llama")) is None
    for arch in ("qwen2", "llama"):  # a GGUF holding only its metadata is enough to read the architecture
        w = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
    with pytest.raises(llama_cpp.LlamaCppError, match="the qwen2 target"):
        llama_cpp.Server(tmp_path / "qwen2.gguf", draft=tmp_path / "head.gguf", spec_type="draft-dspark", root=tmp_path)
    llama_cpp.Server(tmp_path / "llama.gguf", draft=tmp_path / "head.gguf", spec_type="draft-eagle3", root=tmp_path)
    llama_cpp.Server(tmp_path / "qwen2.gguf", draft=tmp_path / "d.gguf", spec_type="draft-simple", root=tmp_path)


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


@pytest.mark.real
@pytest.mark.slow  # ~40 s with a built llama.cpp
def test_llama_cpp_real_server_drafts_with_an_exported_dspark_head(smollm2, served, tmp_path):
    """A DSpark head (block of 4, its previous-token bias chained through the block) exported with
    ``--to llama.cpp`` (speculators' dspark layout, then llama.cpp's converter) and served with
    ``--spec-type draft-dspark``: greedy output identical to plain llama-server, and what the server accepts
    is what eaglekit's own drafting of the same head accepts on those outputs (within 5%: f16 weights and
    llama.cpp's arithmetic may flip a near tie; on 2026-12-03 they were equal prompt by prompt)."""
    from eaglekit.export import load_head

    root, model, prompts, refs, convs = served
    fitted = fit_head(smollm2, convs, tmp_path / "fit", "head.kind=dspark", "head.block_size=4", "head.num_layers=1",
                      "head.markov_rank=64", "head.init_from_target=true", "optim.epochs=20")
    head = load_head(fitted, smollm2)
    assert head.config.kind == "dspark" and float(head.markov_w2.weight.abs().max()) > 0  # the bias trained
    gguf = export_head(head, tmp_path / "gguf", "llama.cpp", gguf_type="f16")
    with llama_cpp.Server(model, draft=gguf, spec_type="draft-dspark", n_max=3, root=root,
                          threads=SERVER_THREADS) as s:
        outs = [s.complete(ids, 40) for ids in prompts]
    for i, (ref, out) in enumerate(zip(refs, outs)):
        assert out.tokens == ref, f"dspark head, prompt {i}: output differs from plain llama-server"
    reps = [replay(ids + o.tokens, len(ids), *head_drafts(smollm2, head, ids, o.tokens, 3), n_max=3)
            for ids, o in zip(prompts, outs)]
    server, ours = sum(o.accepted for o in outs), sum(r["accepted"] for r in reps)
    assert abs(server - ours) <= 0.05 * ours, ([o.accepted for o in outs], [r["accepted"] for r in reps])
    assert sum(o.accepted for o in outs) / sum(o.draft_n for o in outs) > 0.15
