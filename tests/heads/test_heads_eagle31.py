"""EAGLE 3.1's head options (HeadConfig.fc_norm / norm_output) on a tiny target: off by default and then the
EAGLE-3 path unchanged; on, a norm per tap before fc and the post-norm hidden state fed to the next draft
step, the same in training's unroll and in sequential drafting; saved, loaded, exported (the engines'
reading of the flags is in tests/export/test_export_engines); greedy decoding still exact; refusals name the item.
norm_before_fc (one norm over the concatenated taps, what llama.cpp serves) goes through the same checks."""
import json

import pytest
import torch
from helpers import tiny_target

from eaglekit import decode
from eaglekit.config import ConfigError
from eaglekit.decode.drafters import TreeSpec
from eaglekit.export import export_head, load_head
from eaglekit.export.formats import ExportError
from eaglekit.heads import HeadCache, HeadConfig, build_head
from eaglekit.heads.objectives import shift_left, ttt_unroll
from eaglekit.train.config import load_train_config

pytestmark = pytest.mark.usefixtures("one_thread")
V, H = 64, 32


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=V, hidden=H, layers=12)


def make(target, seed=0, **flags):
    torch.manual_seed(seed)
    # taps out of layer order: engines read them sorted, so fc's blocks (and fc_norm's norms) get permuted
    head = build_head(HeadConfig.from_target(target, kind="eagle3", draft_vocab_size=V, aux_layer_ids=[9, 1, 5],
                                             **flags), target)
    with torch.no_grad():  # random weights and norms: a skipped or misplaced norm changes every output
        for name, p in head.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if "norm" in name else p + torch.randn_like(p) * 0.05)
    return head


def features(target, head, ids):
    return head.fuse(target.forward(ids, layer_ids=head.taps).taps)


def test_heads_eagle31_off_by_default_is_the_eagle3_path(target):
    head = make(target)
    assert not head.config.fc_norm and not head.config.norm_output
    assert not any(k.startswith("fc_norm") for k in head.state_dict())  # the state dict EAGLE-3 heads have
    ids = torch.randint(0, V, (1, 8))
    taps = target.forward(ids, layer_ids=head.taps).taps
    assert torch.equal(head.fuse(taps), head.fc(taps))
    hidden, logits = head.step(ids, head.fuse(taps), torch.arange(8)[None])
    assert torch.equal(head.lm_head(head.norm(hidden)), logits)  # hidden is the pre-norm state
    assert not torch.allclose(head.norm(hidden), hidden, atol=1e-3)


def test_heads_eagle31_fc_norm_normalises_each_tap(target):
    head = make(target, fc_norm=True)
    n = len(head.taps)
    assert [k for k in head.state_dict() if k.startswith("fc_norm")] == [f"fc_norm.{i}.weight" for i in range(n)]
    taps = torch.randn(1, 6, n * H, generator=torch.Generator().manual_seed(0))  # unit scale: eps is negligible
    parts = taps.chunk(n, dim=-1)
    want = head.fc(torch.cat([norm(p) for norm, p in zip(head.fc_norm, parts)], dim=-1))
    assert torch.equal(head.fuse(taps), want)
    rescaled = torch.cat([p * s for p, s in zip(parts, (10.0, 0.2, 3.0))], dim=-1)  # per-tap scales
    torch.testing.assert_close(head.fuse(rescaled), want, atol=1e-4, rtol=1e-4)  # no tap dominates g
    plain = make(target)
    assert not torch.allclose(plain.fuse(rescaled), plain.fuse(taps), atol=1e-2)


def test_heads_norm_before_fc_normalises_the_concatenated_taps(target):
    head = make(target, norm_before_fc=True)
    n = len(head.taps)
    assert head.input_norm.weight.shape == (n * H,) and not hasattr(head, "fc_norm")
    taps = torch.randn(1, 6, n * H, generator=torch.Generator().manual_seed(0))
    assert torch.equal(head.fuse(taps), head.fc(head.input_norm(taps)))
    torch.testing.assert_close(head.fuse(taps * 7.0), head.fuse(taps), atol=1e-4, rtol=1e-4)  # one scale for all
    parts = taps.chunk(n, dim=-1)
    rescaled = torch.cat([p * s for p, s in zip(parts, (10.0, 0.2, 3.0))], dim=-1)
    assert not torch.allclose(head.fuse(rescaled), head.fuse(taps), atol=1e-2)  # unlike fc_norm's per-tap norms


def test_heads_eagle31_norm_output_feeds_the_post_norm_state(target):
    head, plain = make(target, norm_output=True), make(target)
    plain.load_state_dict(head.state_dict())  # the same weights, only the feedback differs
    ids = torch.randint(0, V, (1, 8))
    g, pos = features(target, head, ids), torch.arange(8)[None]
    hidden, logits = head.step(ids, g, pos)
    pre, plain_logits = plain.step(ids, g, pos)
    assert torch.equal(logits, plain_logits) and torch.equal(hidden, head.norm(pre))
    assert torch.equal(head.lm_head(hidden), logits)
    # the next draft step reads it: step 1 of the unroll differs from the pre-norm head's
    one = [lg for k, _, lg in ttt_unroll(head, ids, g, 2)][1]
    two = [lg for k, _, lg in ttt_unroll(plain, ids, g, 2)][1]
    assert not torch.allclose(one, two, atol=1e-3)


@torch.no_grad()
def test_heads_eagle31_unroll_equals_sequential_drafting(target):
    """Training's TTT step k at element t is what chain drafting from prefix t reads at depth k."""
    head = make(target, fc_norm=True, norm_output=True)
    ids = torch.randint(7, V, (2, 12), generator=torch.Generator().manual_seed(1))
    g0 = features(target, head, ids)
    steps, S = 3, ids.shape[1]
    unrolled = {k: (h, lg) for k, h, lg in ttt_unroll(head, ids, g0, steps)}
    for b in range(2):
        for t in (0, 4, S - 5):
            cache = HeadCache()
            h, _ = head.step(shift_left(ids, 1)[b:b + 1, :t + 1], g0[b:b + 1, :t + 1], torch.arange(t + 1)[None],
                             cache=cache)
            g = h[:, t:t + 1]
            for k in range(1, steps):
                g, lg = head.step(ids[b:b + 1, t + 1 + k:t + 2 + k], g, torch.tensor([[t + k]]), cache=cache)
                torch.testing.assert_close(g[0, 0], unrolled[k][0][b, t], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(lg[0, 0], unrolled[k][1][b, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flags", [{"fc_norm": True, "norm_output": True}, {"norm_before_fc": True, "norm_output": True}],
                         ids=["eagle31", "norm_before_fc"])
def test_heads_eagle31_saved_loaded_exported(target, tmp_path, flags):
    head = make(target, **flags)
    ids = torch.randint(0, V, (1, 7))

    def two_steps(h):
        g = features(target, h, ids)
        return torch.cat([lg for _, _, lg in ttt_unroll(h, ids, g, 2)])

    want = two_steps(head)
    head.save_pretrained(tmp_path / "native")
    saved = json.loads((tmp_path / "native" / "config.json").read_text())
    assert all(saved[k] is True for k in flags)
    for layout in ("vllm", "sglang", "speculators"):
        out = export_head(head, tmp_path / layout, layout, verifier="me/tiny")
        cfg = json.loads((out / "config.json").read_text())
        assert all(cfg[k] is True for k in flags)  # where every engine reads them
    for folder in ("native", "vllm", "sglang", "speculators"):
        back = load_head(tmp_path / folder, target)  # taps [9, 1, 5] written sorted: the norms move with fc
        assert all(getattr(back.config, k) for k in flags), folder
        torch.testing.assert_close(two_steps(back), want, atol=1e-6, rtol=1e-6)
    plain = export_head(make(target), tmp_path / "plain", "vllm")
    cfg = json.loads((plain / "config.json").read_text())
    assert not {"fc_norm", "norm_output", "norm_before_fc"} & set(cfg)  # an EAGLE-3 export as before


@pytest.mark.parametrize("flags", [{"fc_norm": True, "norm_output": True}, {"norm_before_fc": True}],
                         ids=["eagle31", "norm_before_fc"])
def test_heads_eagle31_greedy_decoding_is_exact(target, flags):
    head = make(target, **flags)
    for i, n in enumerate((20, 31)):
        ids = torch.randint(3, V, (1, 5 + i), generator=torch.Generator().manual_seed(i))
        ref = target.model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
        out = decode.generate(target, head, ids, n, tree=TreeSpec(depth=3, top_k=3, total_tokens=8),
                              eos_token_id=False)
        assert out.sequences.tolist() == ref.tolist()


def test_heads_eagle31_refusals(target, tmp_path):
    with pytest.raises(ValueError, match="eagle1 head"):
        HeadConfig.from_target(target, kind="eagle1", fc_norm=True)
    head = make(target, fc_norm=True)
    with pytest.raises(ExportError, match=r"SafeAILab/EAGLE.*does not read fc_norm"):
        export_head(head, tmp_path / "e1", "eagle1")
    assert not (tmp_path / "e1").exists()
    base = ["data.features_dir=x", "target=tiny"]
    cfg = load_train_config(None, base + ["head.fc_norm=true", "head.norm_output=true"])
    assert cfg.head.fc_norm and cfg.head.norm_output
    with pytest.raises(ConfigError, match=r"head.norm_before_fc with head.kind='eagle1'"):
        load_train_config(None, base + ["head.kind=eagle1", "head.norm_output=true"])
    with pytest.raises(ValueError, match="exclude each other"):
        HeadConfig.from_target(target, kind="eagle3", fc_norm=True, norm_before_fc=True)
    with pytest.raises(ConfigError, match="exclude each other"):
        load_train_config(None, base + ["head.fc_norm=true", "head.norm_before_fc=true"])


def test_heads_eagle31_foreign_checkpoint_reads_the_engine_fields(target, tmp_path):
    """A 3.1 head another trainer wrote (no eaglekit block) is read from the fields engines read."""
    head = make(target, fc_norm=True, norm_output=True)
    out = export_head(head, tmp_path / "x", "sglang")
    cfg = json.loads((out / "config.json").read_text())
    for key in ("eaglekit", "eaglekit_export"):
        del cfg[key]
    (out / "config.json").write_text(json.dumps(cfg))
    back = load_head(out, target)
    assert back.config.fc_norm and back.config.norm_output
    ids = torch.randint(0, V, (1, 6))
    g = features(target, back, ids)
    torch.testing.assert_close(torch.cat([lg for _, _, lg in ttt_unroll(back, ids, g, 2)]),
                               torch.cat([lg for _, _, lg in ttt_unroll(head, ids, features(target, head, ids), 2)]))
    del cfg["norm_output"]  # absent = off, for every engine and for eaglekit
    (out / "config.json").write_text(json.dumps(cfg))
    assert not load_head(out, target).config.norm_output
