"""The parallel drafters (heads.base.ParallelHead): P-EAGLE (and DFlash, in its own functions) built
from a target, saved and loaded, drafting a block in one forward, and their training objectives checked
against naive references (value and gradient) on tiny random targets."""
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from helpers import fused_features, randomize_norms, tiny_target

from eaglekit.export import load_head
from eaglekit.heads import HeadCache, HeadConfig, build_head
from eaglekit.heads.base import ParallelHead

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=4, vocab_size=64)


def peagle(target, block=4, layers=2, draft_vocab=48, seed=0, taps=None):
    cfg = HeadConfig.from_target(target, kind="peagle", num_layers=layers, block_size=block,
                                 draft_vocab_size=draft_vocab, aux_layer_ids=taps)
    torch.manual_seed(seed)
    return build_head(cfg, target)


# ---- P-EAGLE ------------------------------------------------------------------------------------------

def test_peagle_config_build_and_interface(target):
    head = peagle(target, block=5)
    cfg = head.config
    assert isinstance(head, ParallelHead) and head.parallel and not build_head(
        HeadConfig.from_target(target, kind="eagle3"), target).parallel
    assert (cfg.kind, cfg.block_size, head.draft_depths, cfg.num_layers) == ("peagle", 5, 5, 2)
    assert head.taps == tuple(target.default_taps) and head.mask_hidden.shape == (len(head.taps) * 32,)
    assert 0 <= cfg.mask_token_id < target.vocab_size
    assert HeadConfig.from_target(target, kind="peagle").block_size == 4  # the kind's default block
    assert isinstance(head.new_cache(), HeadCache) and head.new_cache().length == 0
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        HeadConfig(**{**cfg.to_dict(), "block_size": 0})
    with pytest.raises(ValueError, match="mask_token_id -1 must be a target token id"):
        build_head(HeadConfig(**{**cfg.to_dict(), "mask_token_id": -1}), target)


def _naive_block_logits(head, ids, g, pos_last, depth_slots):
    """Logits of one block computed the slow way: the whole sequence and its mask slots in one uncached
    causal step (no cache trickery)."""
    m_ids, m_g = head.mask_elements(1, depth_slots)
    pos = torch.cat([torch.arange(ids.shape[1]), pos_last + torch.arange(1, depth_slots + 1)])[None]
    _, logits = head.step(torch.cat([ids, m_ids], 1), torch.cat([g, m_g], 1), pos)
    return logits[:, ids.shape[1] - 1:]


def test_peagle_draft_is_one_forward_and_keeps_only_the_pending_elements(target):
    head = peagle(target, block=4)
    torch.manual_seed(1)
    ids, g = torch.randint(0, 64, (1, 9)), torch.randn(1, 9, 32)
    cache = head.new_cache()
    with torch.no_grad():
        first = head.draft(cache, ids[:, :6], g[:, :6], torch.arange(6)[None])
        assert cache.length == 6  # the block's 3 mask slots are not kept
        calls = []
        hook = head.layers[0].register_forward_hook(lambda *a: calls.append(1))
        second = head.draft(cache, ids[:, 6:], g[:, 6:], torch.arange(6, 9)[None])
        hook.remove()
        assert calls == [1] and cache.length == 9 and second.shape == (1, 4, 48)
        torch.testing.assert_close(first, _naive_block_logits(head, ids[:, :6], g[:, :6], 5, 3))
        torch.testing.assert_close(second, _naive_block_logits(head, ids, g, 8, 3))
    with pytest.raises(ValueError, match=r"g must be \[1, 3, 32\]"):
        head.draft(cache, ids[:, :3], g[:, :2], torch.arange(3)[None])


def test_peagle_save_load_and_fingerprint(target, tmp_path):
    head = peagle(target, block=3)
    head.save_pretrained(tmp_path / "h")
    back = load_head(tmp_path / "h", target)
    assert type(back) is type(head) and back.config.to_dict() == head.config.to_dict()
    for (n, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(a, b, msg=n)
    other = tiny_target("llama", layers=5, vocab_size=64)
    with pytest.raises(ValueError, match="not trained for this target"):
        load_head(tmp_path / "h", other)


def _loss_settings(decay=0.7, **kw):
    return SimpleNamespace(chunk_tokens=7, step_decay=decay, cache_teacher_mb=0.0, topk=0, topk_weight=0.0,
                           ttt_steps=4, noise=0.0, **kw)


def _batch(target, head, B=2, S=10, seed=3):
    torch.manual_seed(seed)
    ids = torch.randint(0, 64, (B, S))
    out = target.forward(ids, layer_ids=head.taps)
    mask = torch.ones(B, S)
    mask[1, 7:] = 0  # a right-padded row
    mask[0, :2] = 0  # a prompt the loss does not learn
    return {"input_ids": ids, "loss_mask": mask, "last": out.last, "taps": out.taps}


def _naive_peagle_loss(head, teacher, batch, steps, decay, weight=None):
    """Σ over anchors t and depths k < steps of decay^k · CE(teacher at t+1+k, block depth k+1 at t), each
    block run on its own, uncached; counted where loss_mask[t+2+k] = 1 and the teacher argmax is drafted."""
    ids, mask, last = batch["input_ids"], batch["loss_mask"], batch["last"]
    g = head.fuse(batch["taps"])
    B, S = ids.shape
    total = torch.zeros(())
    to_draft = head.target_to_draft(torch.arange(64))
    for b in range(B):
        for t in range(S):
            for k in range(steps):
                if t + 2 + k >= S or mask[b, t + 2 + k] == 0:
                    continue
                p_full = torch.softmax(last[b, t + 1 + k] @ teacher.lm_head_weight.T, -1)
                if to_draft[p_full.argmax()] < 0:
                    continue
                m_ids, m_g = head.mask_elements(1, k)
                tok = torch.cat([ids[b:b + 1, 1:t + 2], m_ids], 1)
                pos = torch.arange(t + 1 + k)[None]
                _, logits = head.step(tok, torch.cat([g[b:b + 1, :t + 1], m_g], 1), pos)
                p = torch.softmax(last[b, t + 1 + k] @ teacher.draft_weight.T, -1)
                w = decay ** k if weight is None else weight(b, t, k)
                total = total - w * (p * torch.log_softmax(logits[0, -1], -1)).sum()
    return total


def test_peagle_objective_matches_naive_reference_value_and_gradient(target):
    from eaglekit.heads.objectives import Teacher

    head = peagle(target, block=3, draft_vocab=40)
    ids = torch.randperm(64)[:40].sort().values  # a non-trivial draft vocabulary: some argmaxes fall outside
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[ids] = True
    head.set_draft_vocab(ids - torch.arange(40), t2d)
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    batch = _batch(target, head)
    loss, stats = head.training_loss(teacher, batch, _loss_settings(), steps=3)
    grads = torch.autograd.grad(loss, [head.mask_hidden, head.fc.weight, head.layers[1].mlp.up_proj.weight])
    want = _naive_peagle_loss(head, teacher, batch, 3, 0.7)
    want_grads = torch.autograd.grad(want, [head.mask_hidden, head.fc.weight, head.layers[1].mlp.up_proj.weight])
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    assert len(stats.total) == 3 and stats.total[0] == int(batch["loss_mask"][:, 2:].sum())
    assert all(c <= t for c, t in zip(stats.chain, stats.correct))
    # depths past the block are reported as misses, so every kind's stats have `steps` entries
    _, more = head.training_loss(teacher, batch, _loss_settings(), steps=5)
    assert len(more.total) == 5 and more.correct[3:] == [0, 0] and more.total[3] > 0


@pytest.mark.parametrize("cpu_flash", [True, False], ids=["cpu-flash", "chunked"])
def test_peagle_cod_trains_and_runs_only_a_nested_share_of_anchors_per_depth(target, monkeypatch, cpu_flash):
    """COD: depth k+1 trains the anchors whose draw is below max(r^k, floor), nested, and runs only as many
    anchors as a row keeps: value and gradients equal the naive per-anchor loss, on both attention paths."""
    from eaglekit.heads import ttt_attention
    from eaglekit.heads.objectives import Teacher

    monkeypatch.setattr(ttt_attention, "USE_CPU_FLASH", cpu_flash)
    monkeypatch.setattr(ttt_attention, "CHUNK_ELEMENTS", 300)  # several row chunks in the chunked path
    head = peagle(target, block=4, draft_vocab=40)
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    batch = _batch(target, head, S=16)
    batch["loss_mask"][1, :6] = 0  # a prompt: its anchors supervise nothing past depth 1, so never run there
    r, floor = 0.5, 0.3
    draws = head.cod_draws(batch, train=False)  # the seed the first training call uses
    assert torch.equal(draws, head.cod_draws(batch, train=False))
    cod = _loss_settings(cod_ratio=r, cod_floor=floor)
    ran = []
    hook = head.lm_head.register_forward_hook(lambda m, i, o: ran.append(i[0].shape[1]))
    loss, stats = head.training_loss(teacher, batch, cod, steps=4)
    hook.remove()
    params = [head.mask_hidden, head.fc.weight, head.layers[1].mlp.up_proj.weight]
    grads = torch.autograd.grad(loss, params)
    want = _naive_peagle_loss(head, teacher, batch, 4, 0.7,
                              weight=lambda b, t, k: float(draws[b, t] < max(r ** k, floor)))
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(grads, torch.autograd.grad(want, params)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    kept = [(draws < max(r ** k, floor)).sum().item() for k in range(4)]
    assert kept[0] == draws.numel() and kept[0] > kept[1] >= kept[2] >= kept[3]  # depth 1 all, then fewer, nested
    # depth 1 runs every anchor; depth k+1 >= 2 exactly as many as the row keeping the most there keeps, counting
    # only anchors some depth >= 2 supervises (loss_mask at t+2+j, j >= 1), anchor by anchor
    mask = batch["loss_mask"].tolist()

    def supervised_later(b, t):
        return any(t + 2 + j < 16 and mask[b][t + 2 + j] for j in range(1, 4))

    want = [16] + [max(1, max(sum(1 for t in range(16) if draws[b, t] < max(r ** k, floor) and supervised_later(b, t))
                              for b in range(len(mask)))) for k in range(1, 4)]
    assert ran == want and want[1] < 16, (ran, want)
    assert stats.total[0] == int(batch["loss_mask"][:, 2:].sum()) and stats.total[1] < stats.total[0]
    assert all(c <= t for c, t in zip(stats.chain, stats.correct))
    again, _ = head.training_loss(teacher, batch, cod, steps=4)  # the next epoch draws other anchors
    assert not torch.allclose(again, loss)
    plain, _ = head.training_loss(teacher, batch, _loss_settings(), steps=4, train=False)
    scored, _ = head.training_loss(teacher, batch, cod, steps=4, train=False)  # evaluation: every anchor
    torch.testing.assert_close(scored, plain)


def _naive_chain_stats(top, loss_mask, steps, kept, drafted=0):
    """(correct, total, chain) per depth, anchor by anchor, for a head that drafts ``drafted`` everywhere:
    anchor t at depth k+1 counts where loss_mask[t+2+k] = 1 and ``kept(b, t, k)``; it is right where the
    teacher's argmax at t+1+k (``top``, draft ids) is ``drafted``, and in the chain where depths 1..k+1 all are."""
    B, S = top.shape
    out = [[0] * steps for _ in range(3)]
    for b in range(B):
        for t in range(S):
            for k in range(steps):
                if t + 2 + k >= S or not loss_mask[b, t + 2 + k] or not kept(b, t, k):
                    continue
                right = [int(top[b, t + 1 + j]) == drafted for j in range(k + 1)]
                out[0][k] += right[-1]
                out[1][k] += 1
                out[2][k] += all(right)
    return out


@pytest.mark.parametrize("cod", [0.0, 0.5])
def test_peagle_chain_statistic_is_every_depth_so_far_right(target, cod):
    """StepStats.chain at depth k+1 counts the anchors whose depths 1..k+1 were all right (what a chain
    draft accepts), also under COD, where depths >= 2 run a reordered share of the anchors. The head drafts
    draft id 0 everywhere (a zero lm_head: ties go to the first id) and the teacher's argmax is 0 at random
    positions, so correct, total and chain follow from ``top`` alone, and chain < correct at depths >= 2."""
    from eaglekit.heads.objectives import Teacher

    head = peagle(target, block=4, draft_vocab=40)
    with torch.no_grad():
        head.lm_head.weight.zero_()
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    batch = _batch(target, head, S=16)
    batch["top"] = (torch.rand(2, 16, generator=torch.Generator().manual_seed(0)) > 0.7).long()  # 0 at ~70%
    draws = head.cod_draws(batch, train=False)  # the seed the first training call uses
    _, stats = head.training_loss(teacher, batch, _loss_settings(cod_ratio=cod, cod_floor=0.3), steps=4)
    kept = (lambda b, t, k: True) if not cod else (lambda b, t, k: float(draws[b, t]) < max(cod ** k, 0.3))
    correct, total, chain = _naive_chain_stats(batch["top"], batch["loss_mask"], 4, kept)
    assert (stats.correct, stats.total, stats.chain) == (correct, total, chain)
    assert chain[0] == correct[0] and all(0 < chain[k] < correct[k] for k in (1, 2)), (correct, chain)


def test_peagle_trains_saves_exports_and_decodes_its_own_embedding(target, tmp_path):
    """head.train_embedding (P-EAGLE's reference recipe, speculators' embed_requires_grad): the head starts
    from a copy of the target's embedding, trains that copy (never the target's), saves and exports it
    (speculators: embed_requires_grad written out, loaded back), drafts with it, and decodes exactly."""
    from helpers import hf_greedy

    from eaglekit import decode
    from eaglekit.engines import llama_cpp
    from eaglekit.export.formats import ExportError, export_head
    from eaglekit.heads import save_head
    from eaglekit.heads.objectives import Teacher

    with pytest.raises(ValueError, match="train_embedding is an EAGLE-3 / P-EAGLE option"):
        HeadConfig.from_target(target, kind="dflash", train_embedding=True)
    cfg = HeadConfig.from_target(target, kind="peagle", num_layers=2, block_size=3, draft_vocab_size=48,
                                 aux_layer_ids=[0, 1, 3], train_embedding=True)
    torch.manual_seed(0)
    head = build_head(cfg, target)
    own, theirs = head.embed_tokens.weight, target.embed_tokens.weight
    assert torch.equal(own, theirs) and own.data_ptr() != theirs.data_ptr()
    loss, _ = head.training_loss(Teacher.build(target.lm_head.weight, head.t2d), _batch(target, head),
                                 _loss_settings(), steps=3)
    loss.backward()
    assert own.grad is not None and own.grad.abs().sum() > 0 and theirs.grad is None
    with torch.no_grad():  # a trained embedding: no longer the target's
        own.add_(torch.randn_like(own))
    ids = torch.randint(0, 64, (1, 7))
    g = head.fuse_output(target.forward(ids[:, :-1], layer_ids=head.taps))
    with torch.no_grad():
        block = head.draft(head.new_cache(), ids[:, 1:], g, torch.arange(6)[None])
        frozen = peagle(target, block=3, draft_vocab=48, taps=[0, 1, 3])  # the same weights reading the target's embedding
        frozen.load_state_dict({k: v for k, v in head.state_dict().items() if k != "embed_tokens.weight"})
        assert not torch.allclose(block, frozen.draft(frozen.new_cache(), ids[:, 1:], g, torch.arange(6)[None]))
    for p in ([2, 8, 9, 10], [2, 30, 31, 32, 33]):  # the target verifies: still its own greedy tokens
        out = decode.generate(target, head, torch.tensor([p]), 12, tree={"depth": 3, "top_k": 2, "total_tokens": 5},
                              eos_token_id=False)
        assert torch.equal(out.sequences, hf_greedy(target, p, 12)), p
    back = load_head(save_head(head, tmp_path / "saved"), target)
    assert back.config.train_embedding and torch.equal(back.embed_tokens.weight, own)
    out = export_head(head, tmp_path / "spec", "speculators", verifier="org/tiny")
    assert json.loads((out / "config.json").read_text())["embed_requires_grad"] is True
    from safetensors.torch import load_file
    torch.testing.assert_close(load_file(str(out / "model.safetensors"))["embed_tokens.weight"], own.detach())
    again = load_head(out, target)
    assert again.config.train_embedding and torch.equal(again.embed_tokens.weight, own)
    eagle3 = build_head(HeadConfig.from_target(target, kind="eagle3", aux_layer_ids=[0, 1, 3], train_embedding=True),
                        target)
    vllm = load_file(str(export_head(eagle3, tmp_path / "vllm", "vllm") / "model.safetensors"))
    assert torch.equal(vllm["embed_tokens.weight"], eagle3.embed_tokens.weight)  # vLLM reads a draft's own
    with pytest.raises(ExportError, match="sglang layout cannot hold a head with its own trained embedding"):
        export_head(eagle3, tmp_path / "sglang", "sglang")
    assert "head.train_embedding=true" in llama_cpp.refusal(dataclasses.replace(
        eagle3.config, fc_norm=False, norm_output=False, norm_before_fc=True))
    # a frozen P-EAGLE says so: speculators' own P-EAGLE default is a trained embedding
    plain = export_head(peagle(target, block=3, taps=[0, 1, 3]), tmp_path / "plain", "speculators", verifier="org/tiny")
    assert json.loads((plain / "config.json").read_text())["embed_requires_grad"] is False


# ---- DFlash ------------------------------------------------------------------------------------------

def dflash(target, block=5, layers=2, draft_vocab=48, seed=0):
    cfg = HeadConfig.from_target(target, kind="dflash", num_layers=layers, block_size=block,
                                 draft_vocab_size=draft_vocab)
    torch.manual_seed(seed)
    return randomize_norms(build_head(cfg, target))  # a skipped or misplaced norm changes the output


def test_dflash_config_build_and_interface(target):
    from eaglekit.heads.dflash import DFlashHead

    head = dflash(target, block=5)
    cfg = head.config
    assert isinstance(head, DFlashHead) and isinstance(head, ParallelHead) and head.parallel
    assert (cfg.kind, cfg.block_size, head.draft_depths, cfg.num_layers) == ("dflash", 5, 4, 2)
    assert head.taps == tuple(target.default_taps) and head.fc.weight.shape == (32, 32 * len(head.taps))
    assert HeadConfig.from_target(target, kind="dflash").block_size == 8  # the kind's default block
    assert 0 <= cfg.mask_token_id < target.vocab_size
    assert isinstance(head.new_cache(), HeadCache) and head.new_cache().length == 0
    # the head owns neither an embedding nor an lm_head: both are the target's, frozen
    assert not any("embed" in n or "lm_head" in n for n in head.state_dict())
    with pytest.raises(ValueError, match="block_size must be >= 2 for a dflash head"):
        build_head(HeadConfig.from_target(target, kind="dflash", block_size=1), target)
    with pytest.raises(ValueError, match="mask_token_id must be a target token id"):
        build_head(HeadConfig.from_target(target, kind="dflash", mask_token_id=64), target)
    ids, g = fused_features(target, head)
    with pytest.raises(ValueError, match="g must be"):
        head.draft(head.new_cache(), ids[:, 1:4], g[:, :2], torch.arange(3)[None])


def test_dflash_draft_appends_context_and_equals_a_from_scratch_forward(target):
    """Drafting in pieces (the decode loop's calls) = one call over the whole context; the cache holds the
    context only (never the block); the logits equal a naive recomputation of the block from scratch."""
    from dflash_reference import naive_block_logits

    head = dflash(target, block=5)
    ids, g = fused_features(target, head)
    cache = head.new_cache()
    head.draft(cache, ids[:, 1:5], g[:, :4], torch.arange(4)[None])
    assert cache.length == 4
    pieces = head.draft(cache, ids[:, 5:10], g[:, 4:9], torch.arange(4, 9)[None])
    assert cache.length == 9 and pieces.shape == (1, head.draft_depths, 48)
    whole = head.draft(head.new_cache(), ids[:, 1:10], g[:, :9], torch.arange(9)[None])
    torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        naive = naive_block_logits(head, g, ids, t=8)
    torch.testing.assert_close(whole[0], naive, rtol=1e-4, atol=1e-5)
    assert torch.equal(whole[0].argmax(-1), naive.argmax(-1))
    # rollback is truncation: crop to 6 elements, append 3 more = the whole context of 9 again
    cache.crop(6)
    again = head.draft(cache, ids[:, 7:10], g[:, 6:9], torch.arange(6, 9)[None])
    torch.testing.assert_close(again, whole, rtol=1e-5, atol=1e-5)
    # a batch of 2 rows drafts each row as alone
    ids2, g2 = fused_features(target, head, seed=9)
    both = head.draft(head.new_cache(), torch.cat([ids, ids2])[:, 1:10], torch.cat([g, g2])[:, :9],
                      torch.arange(9)[None])
    torch.testing.assert_close(both[:1], whole, rtol=1e-5, atol=1e-5)
    # positions are read (RoPE): shifted positions give the naive block at those positions; a shift of every
    # position leaves RoPE's relative angles as they were, so only a gap inside the context changes the block
    shifted = head.draft(head.new_cache(), ids[:, 1:10], g[:, :9], 3 + torch.arange(9)[None])
    with torch.no_grad():
        torch.testing.assert_close(shifted[0], naive_block_logits(head, g, ids, t=8, pos0=3), rtol=1e-4, atol=1e-5)
    gapped = head.draft(head.new_cache(), ids[:, 1:10], g[:, :9], torch.cat([torch.arange(4), 20 + torch.arange(5)])[None])
    assert (gapped - whole).abs().max() > 1e-3, (gapped - whole).abs().max()


def test_dflash_draft_vocab_maps_to_target_ids(target):
    from dflash_reference import naive_block_logits

    head = dflash(target, block=3, draft_vocab=40)
    keep = torch.randperm(64)[:40].sort().values
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[keep] = True
    head.set_draft_vocab(keep - torch.arange(40), t2d)
    ids, g = fused_features(target, head)
    logits = head.draft(head.new_cache(), ids[:, 1:8], g[:, :7], torch.arange(7)[None])
    with torch.no_grad():  # the shared lm_head rows of the draft ids, not the first 40 target rows
        hidden = naive_block_logits(head, g, ids, t=6)
    torch.testing.assert_close(logits[0], hidden, rtol=1e-4, atol=1e-5)
    assert set(head.draft_to_target(logits.argmax(-1)).flatten().tolist()) <= set(keep.tolist())
    state = head.state_dict()  # new maps through load_state_dict (in place): the shared rows follow them
    state["d2t"], state["t2d"] = torch.full((40,), 5), torch.arange(64).ge(5) & torch.arange(64).lt(45)
    head.load_state_dict(state)
    torch.testing.assert_close(head.draft_lm_head(), target.lm_head.weight[5:45])


def test_dflash_save_load_and_fingerprint(target, tmp_path):
    head = dflash(target, block=4)
    head.save_pretrained(tmp_path / "h")
    back = load_head(tmp_path / "h", target)
    assert type(back) is type(head) and back.config.to_dict() == head.config.to_dict()
    for (n, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(a, b, msg=n)
    ids, g = fused_features(target, head)
    torch.testing.assert_close(back.draft(back.new_cache(), ids[:, 1:6], g[:, :5], torch.arange(5)[None]),
                               head.draft(head.new_cache(), ids[:, 1:6], g[:, :5], torch.arange(5)[None]))
    other = tiny_target("llama", layers=5, vocab_size=64)
    with pytest.raises(ValueError, match="not trained for this target"):
        load_head(tmp_path / "h", other)


def _vllm_reads_peagle(config: dict, weights: dict, num_spec: int) -> dict:
    """What vLLM's speculators path does with a P-EAGLE folder, as read from its source: the config
    translation (update_peagle) copies draft_vocab_size, target_hidden_size, norm_before_residual (default
    False), the tap ids, and REQUIRES mask_token_id (KeyError otherwise) as ``pard_token``; the parallel
    drafting proposer takes ``pard_token`` as the mask slots' token; Eagle3LlamaForCausalLM.load_weights
    loads ``mask_hidden`` with ``view(1, -1)`` into a [1, fc input] buffer and refuses a folder without it."""
    out = {"pard_token": config["mask_token_id"], "draft_vocab_size": config.get("draft_vocab_size"),
           "norm_before_residual": config.get("norm_before_residual", False),
           "taps": config.get("eagle_aux_hidden_state_layer_ids")}
    if "mask_hidden" not in weights:
        raise ValueError("mask_hidden not found in weights (parallel drafting)")
    fc_in = len(out["taps"]) * config["transformer_layer_config"]["hidden_size"]
    out["mask_hidden"] = weights["mask_hidden"].view(1, -1)
    assert out["mask_hidden"].shape == (1, fc_in)
    out["drafts_per_forward"] = num_spec
    return out


def test_peagle_speculators_export_as_vllm_and_speculators_read_it(target, tmp_path):
    from safetensors.torch import load_file

    from eaglekit.export.formats import ExportError, export_head

    head = peagle(target, block=3, draft_vocab=48, taps=[3, 0, 1])  # engines capture taps sorted: fc permuted
    ids = torch.randperm(64)[:48].sort().values
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[ids] = True
    head.set_draft_vocab(ids - torch.arange(48), t2d)
    out = export_head(head, tmp_path / "spec", "speculators", verifier="org/tiny")
    config = json.loads((out / "config.json").read_text())
    weights = load_file(str(out / "model.safetensors"))
    # speculators 0.9: PEagleSpeculatorConfig (speculators_model_type 'peagle', mask_token_id) over EAGLE-3's
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleSpeculator"]
    assert config["speculators_config"]["algorithm"] == "peagle"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert weights["mask_hidden"].shape == (1, 1, 3 * 32)  # speculators' Parameter shape
    # fc's column blocks (and mask_hidden's, which lives in fc's input space) follow the sorted taps
    blocks = head.mask_hidden.detach().view(3, 32)
    torch.testing.assert_close(weights["mask_hidden"].view(3, 32), blocks[[1, 2, 0]])
    read = _vllm_reads_peagle(config, weights, config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    assert read["pard_token"] == head.config.mask_token_id and read["taps"] == sorted(head.taps)
    assert read["norm_before_residual"] is False and read["draft_vocab_size"] == 48
    # loaded back: the same head (taps sorted), drafting the same block from the same target state
    back = load_head(out, target)
    assert type(back) is type(head) and back.taps == (0, 1, 3)
    assert (back.config.block_size, back.config.mask_token_id) == (3, head.config.mask_token_id)
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        drafts = [h.draft(h.new_cache(), ids[:, 1:], h.fuse_output(target.forward(ids[:, :-1], layer_ids=h.taps)),
                          torch.arange(6)[None]) for h in (head, back)]
    torch.testing.assert_close(drafts[0], drafts[1])
    # the EAGLE-3 layouts have no P-EAGLE fields: refused, naming what is missing
    for layout in ("vllm", "sglang"):
        with pytest.raises(ExportError, match="no P-EAGLE fields \\(mask_hidden, mask_token_id\\)"):
            export_head(head, tmp_path / layout, layout)
    # a folder whose mask token or block disagrees with the head is refused on reading
    bad = dict(config, mask_token_id=(config["mask_token_id"] + 1) % 64)
    (out / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ExportError, match="mask_token_id"):
        load_head(out, target)


@pytest.mark.parametrize("train_embedding", [False, True])
def test_peagle_export_loads_in_speculators_and_computes_our_logits(tmp_path, monkeypatch, train_embedding):
    """A real consumer: speculators 0.9's own PEagleDraftModel loads our speculators export and, at every
    anchor and depth of a sequence, computes the logits our head does (its mask token, mask_hidden, fc,
    layers, block attention and positions; COD sampling replaced by every anchor at every depth) — also
    with the head's own trained embedding (head.train_embedding)."""
    import sys

    from helpers import save_tiny

    from eaglekit.export.formats import export_head
    from eaglekit.target import load_target

    if sys.version_info < (3, 11):
        pytest.skip("speculators needs Python >= 3.11")
    try:
        from speculators.losses import eager
        from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig, core
    except ImportError as e:  # installed by scripts/setup.sh: a missing one is a broken setup, not a skip
        pytest.fail(f"speculators is not importable ({e}); run scripts/setup.sh (speculators extra)")
    tdir = save_tiny(tmp_path / "tiny", layers=6, hidden=32, vocab_size=64)
    tiny = load_target(tdir)
    torch.manual_seed(0)
    head = build_head(HeadConfig.from_target(tiny, kind="peagle", num_layers=2, block_size=3, draft_vocab_size=16,
                                             aux_layer_ids=[4, 1, 2], train_embedding=train_embedding), tiny)
    if train_embedding:  # trained: no longer the target's embedding
        with torch.no_grad():
            head.embed_tokens.weight.add_(torch.randn_like(head.embed_tokens.weight))
    keep = torch.arange(16) * 4 + 2
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[keep] = True
    head.set_draft_vocab(keep - torch.arange(16), t2d)
    out = export_head(head, tmp_path / "spec", "speculators", verifier=str(tdir))
    config = PEagleSpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention's block masks need CUDA
    model = PEagleDraftModel.from_pretrained(str(out), config=config).eval()
    assert model.mask_token_id == head.config.mask_token_id

    S, D = 8, 3
    anchors = torch.cat([torch.arange(S - d) for d in range(D)])
    depths = torch.cat([torch.full((S - d,), d) for d in range(D)])
    monkeypatch.setattr(core, "generate_cod_sample_indices", lambda **kw: (anchors, depths))
    torch.manual_seed(2)
    ids = torch.randint(0, 64, (1, S))
    hidden = tiny.model(ids, output_hidden_states=True).hidden_states  # [k] = input of layer k
    aux = torch.cat([hidden[k] for k in model.config.eagle_aux_hidden_state_layer_ids], dim=-1)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, o: seen.append(o.detach()))
    with torch.no_grad():
        model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), position_ids=torch.arange(S)[None],
              loss_mask=torch.ones(1, S), verifier_last_hidden_states=hidden[-1], num_depths=D,
              loss_config={"kl": (eager.kl_div_loss, 1.0)})
    hook.remove()
    g = head.fuse(tiny.forward(ids, layer_ids=head.taps).taps)  # speculators' element t = (g_t, ids[t])
    with torch.no_grad():
        for i, (a, d) in enumerate(zip(anchors.tolist(), depths.tolist())):
            m_ids, m_g = head.mask_elements(1, d)
            _, ours = head.step(torch.cat([ids[:, :a + 1], m_ids], 1), torch.cat([g[:, :a + 1], m_g], 1),
                                torch.arange(a + 1 + d)[None])
            torch.testing.assert_close(ours[0, -1], seen[0][0, i], rtol=1e-4, atol=1e-4, msg=f"anchor {a} depth {d}")
