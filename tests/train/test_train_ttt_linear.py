"""Training-time-test attention without the [S, (k+1)S] mask (heads.ttt_attention) equals the mask path it
replaced — attention output, the TTT loss and every parameter's gradient, for several steps, lengths,
grouped-query heads, padded batches and chunkings, on both of its paths (CPU flash kernel, chunked) —
and what it keeps for the backward pass grows linearly with the sequence length, where the mask path's
grows with its square. With ``loss.recompute_logits`` the loss, gradients and stats are the same and no step's
logits are kept."""
import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_target

from eaglekit.heads import HeadCache, HeadConfig, build_head, objectives, ttt_attention, ttt_mask
from eaglekit.heads.layers import shift_left
from eaglekit.heads.objectives import Teacher, ttt_loss
from eaglekit.train.config import LossConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def masked_attention(q, keys, values):
    """The mask path: SDPA over every step's keys under ttt_mask (what Attention did before)."""
    rep = q.shape[1] // keys[0].shape[1]
    k = torch.cat(keys, dim=2).repeat_interleave(rep, dim=1)
    v = torch.cat(values, dim=2).repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ttt_mask(q.shape[2], len(keys) - 1, q.dtype))


def masked_unroll(head, input_ids, g, steps, project=True):
    """ttt_unroll as it was: one HeadCache and ttt_mask(S, k) passed to every step."""
    B, S = input_ids.shape
    cache, pos0 = HeadCache(), torch.arange(S).expand(B, S)
    for k in range(steps):
        mask = None if k == 0 else ttt_mask(S, k, g.dtype)
        hidden, logits = head.step(shift_left(input_ids, 1 + k), g, pos0 + k, cache=cache, attn_mask=mask)
        yield k, hidden, logits
        g = hidden


def close_to_scale(new, old, name):
    """Equal within fp32 rounding of a sum over many terms: 1e-5 of the tensor's largest entry (a gradient
    entry that cancels to near 0 carries the rounding of its large terms, so a relative check per entry
    would be too tight)."""
    err, scale = (new - old).abs().max(), old.abs().max()
    assert err <= 1e-5 * scale + 1e-9, f"{name}: max error {float(err):.3g} at scale {float(scale):.3g}"


def qkv(S, steps, heads=4, kv_heads=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, S, d, generator=gen).requires_grad_()
    ks = [torch.randn(2, kv_heads, S, d, generator=gen).mul(2).requires_grad_() for _ in range(steps + 1)]
    vs = [torch.randn(2, kv_heads, S, d, generator=gen).requires_grad_() for _ in range(steps + 1)]
    return q, ks, vs


@pytest.fixture(params=["cpu_flash", "chunked"])
def path(request, monkeypatch):
    """Each implementation of step k >= 1: the CPU flash kernel plus diagonal, and the chunked softmax."""
    monkeypatch.setattr(ttt_attention, "USE_CPU_FLASH", request.param == "cpu_flash")
    assert ttt_attention.uses_cpu_flash(torch.zeros(1)) == (request.param == "cpu_flash"), "path not taken"
    return request.param


def qkv64(S, steps):
    return [t.detach().double().requires_grad_() if not isinstance(t, list) else
            [x.detach().double().requires_grad_() for x in t] for t in qkv(S, steps)]


@pytest.mark.parametrize("S,steps,chunk_elements,dtype", [(1, 1, 2**23, "fp32"), (7, 2, 2**23, "fp32"),
                                                          (33, 3, 2**23, "fp32"), (50, 3, 200, "fp32"),
                                                          (64, 1, 100, "fp32"), (600, 2, 2**23, "fp64")])
def test_ttt_attention_equals_the_masked_softmax_value_and_gradient(monkeypatch, path, S, steps, chunk_elements,
                                                                     dtype):
    """Small chunk_elements force 16-row chunks, so the chunk boundaries (and a ragged last chunk) are tested;
    600 rows span several of the flash kernel's query and key blocks, compared in fp64 (in fp32, a sum over
    600 keys differs by ~1e-5 between any two fp32 implementations, the mask path's own error included)."""
    monkeypatch.setattr(ttt_attention, "CHUNK_ELEMENTS", chunk_elements)
    q, ks, vs = qkv(S, steps) if dtype == "fp32" else qkv64(S, steps)
    w = torch.randn(2, 4, S, 8, generator=torch.Generator().manual_seed(9)).to(q.dtype)  # a generic upstream gradient
    outs, grads = [], []
    for attend in (ttt_attention.ttt_attention, masked_attention):
        out = attend(q, ks, vs)
        assert out.dtype == q.dtype
        outs.append(out)
        grads.append(torch.autograd.grad((out * w).sum(), [q, *ks, *vs]))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for name, a, b in zip(["q"] + [f"k{j}" for j in range(steps + 1)] + [f"v{j}" for j in range(steps + 1)], *grads):
        if dtype == "fp64":
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6, msg=lambda m, n=name: f"grad {n}: {m}")
        else:  # an fp32 entry that cancels to near 0 keeps its terms' rounding: 2.8e-6 on an AVX2-only CPU
            close_to_scale(a, b, f"grad {name}")


def anchored_reference(q, keys, values, anchors):
    """The anchored step by its definition, one masked softmax: query n of row b (anchor a = anchors[b, n]) sees the
    step-0 keys at indices <= a and, of each later step, its own key n (those steps cover the anchors only)."""
    B, _, N, _ = q.shape
    S, steps = keys[0].shape[2], len(keys) - 1
    rep = q.shape[1] // keys[0].shape[1]
    k = torch.cat([keys[0]] + [x[:, :, :N] for x in keys[1:]], dim=2).repeat_interleave(rep, dim=1)
    v = torch.cat([values[0]] + [x[:, :, :N] for x in values[1:]], dim=2).repeat_interleave(rep, dim=1)
    seen = torch.zeros(B, 1, N, S + steps * N, dtype=torch.bool)
    seen[:, 0, :, :S] = torch.arange(S)[None, None, :] <= anchors[:, :, None]
    for j in range(steps):
        seen[:, 0, :, S + j * N:S + (j + 1) * N] = torch.eye(N, dtype=torch.bool)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=seen)


def anchored_inputs(S, N, steps, seed=3):
    """q over N anchors (distinct indices in 0..S-1, in a shuffled order, as COD's draws give them), the step-0 keys
    over S positions, the later steps' over the N anchors."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, N, 8, generator=gen).requires_grad_()
    keys = [torch.randn(2, 2, S if j == 0 else N, 8, generator=gen).mul(2).requires_grad_() for j in range(steps + 1)]
    values = [torch.randn(2, 2, S if j == 0 else N, 8, generator=gen).requires_grad_() for j in range(steps + 1)]
    anchors = torch.stack([torch.randperm(S, generator=gen)[:N] for _ in range(2)])
    return q, keys, values, anchors


@pytest.mark.parametrize("S,N,steps,chunk_elements", [(12, 5, 1, 2**23), (12, 12, 2, 2**23), (40, 17, 3, 120),
                                                      (40, 1, 2, 2**23)])
def test_anchored_ttt_attention_equals_its_definition_value_and_gradient(monkeypatch, path, S, N, steps,
                                                                         chunk_elements):
    """COD's anchored steps (TTTCache.rows) on each path — the CPU flash kernel, the chunked softmax (small
    chunk_elements: several chunks, a ragged last one) — against the masked softmax that defines them."""
    monkeypatch.setattr(ttt_attention, "CHUNK_ELEMENTS", chunk_elements)
    q, keys, values, anchors = anchored_inputs(S, N, steps)
    w = torch.randn(2, 4, N, 8, generator=torch.Generator().manual_seed(9))
    expand = ttt_attention._expand
    ours = ttt_attention._attend(q, [expand(q, k) for k in keys], [expand(q, v) for v in values], anchors)
    ref = anchored_reference(q, keys, values, anchors)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    inputs = [q, *keys, *values]
    for a, b, name in zip(torch.autograd.grad((ours * w).sum(), inputs), torch.autograd.grad((ref * w).sum(), inputs),
                          ["q"] + [f"k{j}" for j in range(steps + 1)] + [f"v{j}" for j in range(steps + 1)]):
        close_to_scale(a, b, f"grad {name}")


def test_anchored_ttt_attention_differs_when_an_anchor_sees_one_key_less(path):
    """The comparison above can fail: the step-0 pattern with ``<`` for ``<=`` (a query blind to its own anchor's
    key) is far outside its tolerance."""
    q, keys, values, anchors = anchored_inputs(12, 5, 1)
    expand = ttt_attention._expand
    ours = ttt_attention._attend(q, [expand(q, k) for k in keys], [expand(q, v) for v in values], anchors)
    blind = anchored_reference(q, keys, values, anchors - 1)  # sees indices <= a - 1
    assert (ours - blind).abs().max() > 1e-2


def test_the_cpu_flash_path_runs_on_this_torch():
    """The fast path is the one the CPU takes (a torch without its ops would silently fall back)."""
    assert ttt_attention.uses_cpu_flash(torch.zeros(1))


def test_ttt_attention_differs_when_the_pattern_does(path):
    """The comparison above can fail: a mask that also lets each row see step 1's key at t-1 gives another output."""
    q, ks, vs = qkv(9, 1)
    wrong = ttt_mask(9, 1)
    wrong[0, 0, :, 9:] = wrong.min()
    rows = torch.arange(9)
    wrong[0, 0, rows, 9 + (rows - 1).clamp(min=0)] = 0.0
    k, v = torch.cat(ks, 2).repeat_interleave(2, 1), torch.cat(vs, 2).repeat_interleave(2, 1)
    other = F.scaled_dot_product_attention(q, k, v, attn_mask=wrong)
    assert (ttt_attention.ttt_attention(q, ks, vs) - other).abs().max() > 1e-2


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=64, hidden=32, layers=6)


def _head(target, kind, **kw):
    torch.manual_seed(0)
    head = build_head(HeadConfig.from_target(target, kind=kind, num_layers=2, **kw), target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # break the symmetric init so every step's attention matters
    return head


def _batch(target, head, S):
    ids = torch.randint(7, 64, (3, S), generator=torch.Generator().manual_seed(S))
    loss_mask = torch.ones_like(ids)
    loss_mask[1, S - 5:] = 0  # right padding, as the collator leaves it
    loss_mask[2, : S // 3] = 0  # an unsupervised prompt
    out = target.features(ids, layer_ids=head.taps)
    return {"input_ids": ids, "loss_mask": loss_mask, "taps": out.taps, "last": out.last}


def _loss_and_grads(head, teacher, batch, loss, monkeypatch, unroll):
    monkeypatch.setattr(objectives, "ttt_unroll", unroll)
    head.zero_grad()
    torch.manual_seed(3)  # EAGLE-1's feature noise draws the same on both paths
    total, stats = head.training_loss(teacher, batch, loss, steps=loss.ttt_steps)
    total.backward()
    return total.detach(), stats, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind,S,steps", [("eagle3", 12, 1), ("eagle3", 23, 3), ("eagle3", 40, 5),
                                          ("eagle1", 19, 3)])
def test_ttt_loss_and_gradients_equal_the_mask_path(target, monkeypatch, path, kind, S, steps):
    monkeypatch.setattr(ttt_attention, "CHUNK_ELEMENTS", 2000)  # several chunks per sequence
    head = _head(target, kind, **({"draft_vocab_size": 48} if kind == "eagle3" else {}))
    teacher = Teacher.build(target.lm_head.weight, head.t2d if kind == "eagle3" else None)
    loss = LossConfig(ttt_steps=steps, step_decay=0.8, chunk_tokens=7, cache_teacher_mb=0.0)
    batch = _batch(target, head, S)
    new, new_stats, new_g = _loss_and_grads(head, teacher, batch, loss, monkeypatch, objectives.ttt_unroll)
    old, old_stats, old_g = _loss_and_grads(head, teacher, batch, loss, monkeypatch, masked_unroll)
    torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-5)
    assert new_stats.total == old_stats.total and new_stats.correct == old_stats.correct
    assert new_g.keys() == old_g.keys() and len(new_g) > 5
    for name in old_g:
        close_to_scale(new_g[name], old_g[name], name)


def test_peagle_block_unroll_equals_the_mask_path(target, monkeypatch, path):
    monkeypatch.setattr(ttt_attention, "CHUNK_ELEMENTS", 2000)
    head = _head(target, "peagle", draft_vocab_size=48, block_size=4)
    batch = _batch(target, head, 21)
    g = head.training_features(batch)

    def masked_blocks(input_ids, g, depths):  # block_unroll as it was: HeadCache + ttt_mask
        B, S = input_ids.shape
        cache, pos0 = HeadCache(), torch.arange(S).expand(B, S)
        m_ids, m_g = head.mask_elements(B, S)
        for k in range(depths):
            tok, feat = (shift_left(input_ids, 1), g) if k == 0 else (m_ids, m_g)
            mask = None if k == 0 else ttt_mask(S, k, g.dtype)
            yield k, head.step(tok, feat, pos0 + k, cache=cache, attn_mask=mask)[1]

    w = torch.randn(3, 21, 48, generator=torch.Generator().manual_seed(5))
    results = []
    for unroll in (head.block_unroll, masked_blocks):
        head.zero_grad()
        logits = torch.stack([lg for _, lg in unroll(batch["input_ids"], g, 4)])
        (logits * w).sum().backward(retain_graph=True)
        results.append((logits.detach(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}))
    (new, new_g), (old, old_g) = results
    torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-5)
    assert new_g.keys() == old_g.keys() and "mask_hidden" in new_g
    for name in old_g:
        close_to_scale(new_g[name], old_g[name], name)


def _saved_bytes(head, teacher, batch, loss, unroll, monkeypatch) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward pass of one TTT loss."""
    monkeypatch.setattr(objectives, "ttt_unroll", unroll)
    seen = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ttt_loss(head, teacher, batch, loss)
    return sum(seen.values())


def test_ttt_memory_kept_for_backward_grows_linearly(target, monkeypatch):
    """Doubling S doubles what either new path keeps (ratio < 2.2), while the mask path's ratio is over 3 at
    these lengths (its masks dominate): the check separates the two."""
    head = _head(target, "eagle3", draft_vocab_size=48)
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    loss = LossConfig(ttt_steps=3, chunk_tokens=64, cache_teacher_mb=0.0)
    ratios = {}
    for name, unroll in (("cpu_flash", objectives.ttt_unroll), ("chunked", objectives.ttt_unroll),
                         ("masked", masked_unroll)):
        monkeypatch.setattr(ttt_attention, "USE_CPU_FLASH", name == "cpu_flash")
        sizes = []
        for S in (1024, 2048):
            ids = torch.randint(7, 64, (1, S), generator=torch.Generator().manual_seed(0))
            batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "last": torch.randn(1, S, 32),
                     "taps": torch.randn(1, S, 32 * len(head.taps))}
            sizes.append(_saved_bytes(head, teacher, batch, loss, unroll, monkeypatch))
        ratios[name] = sizes[1] / sizes[0]
    assert ratios["cpu_flash"] < 2.2 and ratios["chunked"] < 2.2 and ratios["masked"] > 3.0, ratios


@pytest.mark.parametrize("cache_teacher_mb", [0.0, 1.0])  # teacher recomputed from `last`, or cached probabilities
def test_recomputed_logits_train_the_same_and_keep_no_logits(target, monkeypatch, cache_teacher_mb):
    head = _head(target, "eagle3", draft_vocab_size=48)
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    batch = _batch(target, head, 23)
    runs = {}
    for fused in (False, True):
        loss = LossConfig(ttt_steps=3, step_decay=0.8, chunk_tokens=7, cache_teacher_mb=cache_teacher_mb,
                          recompute_logits=fused)
        total, stats, grads = _loss_and_grads(head, teacher, batch, loss, monkeypatch, objectives.ttt_unroll)
        runs[fused] = total, stats, grads, _saved_bytes(head, teacher, batch, loss, objectives.ttt_unroll, monkeypatch)
    (old, old_stats, old_g, old_bytes), (new, new_stats, new_g, new_bytes) = runs[False], runs[True]
    torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-5)
    assert new_stats.correct == old_stats.correct and new_stats.chain == old_stats.chain and sum(old_stats.correct)
    assert new_g.keys() == old_g.keys() and "lm_head.weight" in new_g
    for name in old_g:
        close_to_scale(new_g[name], old_g[name], name)
    logits_bytes = 3 * batch["input_ids"].numel() * 48 * 4  # one fp32 [B, S, Vd] per step
    assert old_bytes - new_bytes >= logits_bytes, (old_bytes, new_bytes, logits_bytes)
