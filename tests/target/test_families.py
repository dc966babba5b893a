"""The 2026 families (tests/arch_matrix.py ``FAMILIES``: Qwen3.5, Qwen3-Next, Nemotron-H, Llama 4, DeepSeek-V3.2 /
V4, GLM-5, Kimi-Linear, the Mamba / convolution hybrids) and VL checkpoints of Qwen3.5's class, each a tiny random
model run by transformers' own forward:

- nothing is refused at load: the taps are the layer inputs transformers lists (``output_hidden_states``), ``last``
  is what the lm_head reads (its logits are the model's);
- every head kind trains on the captured features (finite loss, the parameters move);
- plain decoding, one row and a batch, is transformers' own greedy decoding (the model's own cache);
- chains of drafts on the model's own cache (recurrent, chunked) and trees on eaglekit's (indexed attention, DSA)
  give the target's greedy tokens with every drafter; what cannot be verified exactly is refused before any token;
- a VL checkpoint loads for text (its language model's layers), with and without its decoder, and a head trains on
  text conversations end to end (capture, every kind, held-out τ_sim);
- DFlash's default taps on a hybrid read attention layers' outputs; an encoder built as a decoder gets one error.
"""
import json

import pytest
import torch
from arch_matrix import FAMILIES, tiny_model, tiny_target_of, tiny_vl_model
from helpers import GreedyChain, TreeOracle, hf_greedy, tiny_conversations, tiny_tokenizer

from eaglekit import decode
from eaglekit.heads import KINDS, HeadConfig, build_head
from eaglekit.heads.objectives import Teacher
from eaglekit.target import Target, load_target
from eaglekit.target.architectures import UnsupportedArchitecture, refusal
from eaglekit.train.config import LossConfig

pytestmark = pytest.mark.usefixtures("one_thread")
TRAINED_KINDS = [k for k in KINDS if k not in ("eagle1", "mtp")]  # the kinds that read taps (EAGLE-1 and MTP: `last`)
NEW = 10
_gen = torch.Generator().manual_seed(1)
PROMPTS = [torch.randint(7, 512, (n,), generator=_gen).tolist() for n in (20, 13)]  # longer than every chunk
target = tiny_target_of
INDEXED = ["deepseek_v32", "glm_moe_dsa"]  # indexed sparse attention (DSA): trees on eaglekit's cache
TREE = {"depth": 3, "top_k": 3, "total_tokens": 8}


def layer_inputs(t: Target, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each decoder layer's input as transformers lists it (``output_hidden_states``): embeddings first. Mamba
    lists layer outputs only, so its embeddings are put first; hyper-connection streams are averaged, as taps are."""
    hs = list(t.model(ids, output_hidden_states=True).hidden_states)
    if len(hs) == t.num_layers + 1 and type(t.model).__name__ == "MambaForCausalLM":
        hs = [t.model.get_input_embeddings()(ids)] + hs
    return [h.mean(-2) if h.dim() == 4 else h for h in hs[:t.num_layers]]


@pytest.mark.parametrize("name", FAMILIES)
def test_family_loads_and_taps_its_layer_inputs(name):
    t = target(name)
    assert bool(t.decode_refusal) == t.own_cache == (name not in INDEXED), name  # DSA: eaglekit's cache
    ids = torch.tensor([PROMPTS[0]])
    feats = t.features(ids, layer_ids=range(t.num_layers))
    H = t.hidden_size
    for k, ref in enumerate(layer_inputs(t, ids)):
        torch.testing.assert_close(feats.taps[..., k * H:(k + 1) * H], ref, rtol=0, atol=0)
    assert feats.taps.shape[-1] == t.num_layers * H
    torch.testing.assert_close(t.lm_head(feats.last), t.model(ids).logits, rtol=1e-5, atol=1e-5)
    kept = t.forward(ids, layer_ids=(), logits_to_keep=1)  # a prefill: one row of logits, every row of `last`
    assert kept.logits.shape[1] == 1
    torch.testing.assert_close(kept.last, feats.last, rtol=0, atol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_checkpoint_loads_without_its_decoder(name, tmp_path):
    """Offline training reads only the embedding, final norm and lm_head from the safetensors, by the names the
    checkpoint stores (Nemotron-H's ``backbone.*``, renamed on a whole load) — equal to the whole model's."""
    tiny_model(name).save_pretrained(tmp_path)
    tiny_tokenizer(512).save_pretrained(tmp_path)
    whole, borrowed = load_target(tmp_path), load_target(tmp_path, decoder=False)
    for a, b in ((whole.embed_tokens, borrowed.embed_tokens), (whole.lm_head, borrowed.lm_head)):
        torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)
    if whole.norm is not None:
        torch.testing.assert_close(whole.norm.weight, borrowed.norm.weight, rtol=0, atol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_trains_every_kind(name):
    """One capture of the taps every kind reads, then two optimizer steps of each kind's own objective."""
    t = target(name)
    ids = torch.tensor([PROMPTS[0][:16], PROMPTS[1] + PROMPTS[0][:3]])
    heads = {}
    for kind in TRAINED_KINDS:
        torch.manual_seed(0)
        heads[kind] = build_head(HeadConfig.from_target(t, kind=kind), t).train()
    taps = sorted({i for h in heads.values() for i in h.taps})
    out = t.features(ids, layer_ids=taps)
    H = t.hidden_size
    for kind, head in heads.items():
        cols = [slice(taps.index(i) * H, (taps.index(i) + 1) * H) for i in head.taps]
        batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "last": out.last,
                 "taps": torch.cat([out.taps[..., c] for c in cols], dim=-1)}
        teacher = Teacher.build(t.lm_head.weight, head.t2d)
        opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
        before = [p.detach().clone() for p in head.parameters()]
        for _ in range(2):
            loss, stats = head.training_loss(teacher, batch, LossConfig(ttt_steps=2, anchors=4), steps=2)
            assert torch.isfinite(loss) and loss > 0, (name, kind, loss)
            opt.zero_grad()
            (loss / max(1, sum(stats.total))).backward()
            opt.step()
        assert all(torch.isfinite(p).all() for p in head.parameters()), (name, kind)
        assert any(not torch.equal(a, p) for a, p in zip(before, head.parameters())), (name, kind, "no change")


@pytest.mark.parametrize("name", FAMILIES)
def test_family_plain_decoding_is_the_targets_own(name):
    t = target(name)
    for p in PROMPTS:
        ref = t.model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist()
        out = decode.generate(t, None, torch.tensor([p]), NEW, eos_token_id=False)
        assert out.sequences[0, len(p):].tolist() == ref, name
    batch = decode.generate(t, None, PROMPTS, NEW, eos_token_id=False)  # rows of two lengths
    for b, p in enumerate(PROMPTS):
        alone = decode.generate(t, None, torch.tensor([p]), NEW, eos_token_id=False).sequences[0, len(p):]
        assert batch.sequences[b, max(map(len, PROMPTS)):].tolist() == alone.tolist(), (name, b)
    assert len(batch.stats.rows) == 2 and batch.stats.new_tokens == 2 * NEW


class Recorder:
    """A streamer that records what it is given: a refusal must come before the prompt is even streamed."""

    def __init__(self):
        self.got = []

    def put(self, x):
        self.got.append(x)

    def end(self):
        self.got.append("end")


CHAINED = [n for n in FAMILIES if n not in INDEXED + ["deepseek_v4"]]
REPEATS = PROMPTS[1][:5] * 3 + PROMPTS[1][:2]  # prompt lookup finds its n-grams


@pytest.mark.parametrize("name", CHAINED)
def test_family_chains_decode_as_the_target_does(name):
    """Greedy chains on the model's own cache, its recurrent state recorded and the rejected tail rolled back:
    an oracle chain wrong at depth 3 (two nodes accepted, two rolled back, every step), an EAGLE-3 and a DFlash
    head's chains, prompt lookup and a draft model's chain, all giving transformers' greedy tokens; a batch with the
    oracle, its rows ending apart (an EOS), each row its own greedy answer."""
    from helpers import tiny_target

    t = target(name)
    draft = tiny_target("llama", layers=1, vocab_size=512)
    torch.manual_seed(0)
    eagle3 = build_head(HeadConfig.from_target(t, kind="eagle3"), t)
    dflash = build_head(HeadConfig.from_target(t, kind="dflash", block_size=4), t)
    for prompt in (REPEATS,):  # repeats: lookup finds its n-grams; the oracle rolls back at every step anyway
        ids = torch.tensor([prompt])
        ref = t.model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
        for label, drafter, kw in (("oracle", GreedyChain(t, depth=4, wrong=2), {}), ("eagle3", eagle3, {}),
                                   ("dflash", dflash, {}), ("lookup", None, {"prompt_lookup": 4}),
                                   ("draft model", draft, {"gamma": 3})):
            out = decode.generate(t, drafter, ids, NEW, eos_token_id=False, **kw)
            assert out.sequences[0, len(prompt):].tolist() == ref, (name, label)
            if label == "oracle":  # 3 tokens per full step: 2 accepted nodes and the correction
                assert max(out.stats.accept_lengths) == 3 and out.stats.tau > 2, out.stats.accept_lengths
    # a batch of two prompts (on this cache each row decodes alone), the first row ending at an EOS: every row is
    # its own greedy answer up to its end
    refs = [hf_greedy(t, p, NEW)[0, len(p):].tolist() for p in PROMPTS]
    eos = refs[0][3]
    out = decode.generate(t, [GreedyChain(t, depth=4, wrong=2) for _ in PROMPTS], PROMPTS, NEW, eos_token_id=eos)
    width = out.sequences.shape[1] - NEW
    for b, ref in enumerate(refs):
        want = ref[:ref.index(eos) + 1] if eos in ref else ref
        assert out.sequences[b, width:width + out.stats.rows[b].new_tokens].tolist() == want, (name, b)
    assert out.stats.rows[0].new_tokens <= 4 < out.stats.rows[1].new_tokens or eos in refs[1][:4], name


@pytest.mark.parametrize("name", INDEXED)
def test_indexed_attention_verifies_trees_as_the_target_decodes(name):
    """DSA (DeepSeek-V3.2, GLM-5) on eaglekit's cache, its indexer's keys kept beside the keys: trees whose accepted
    nodes are not the first verify rows (an oracle's second children, a row's keys and indexer keys moved), an
    EAGLE-3 head's tree, a batch of two rows of different lengths, prompt lookup, a draft model, each giving
    transformers' greedy tokens. The prompts pass index_topk (4) keys, so the indexer's selection decides."""
    from helpers import tiny_target

    t = target(name)
    head = build_head(HeadConfig.from_target(t, kind="eagle3"), t)
    draft = tiny_target("llama", layers=1, vocab_size=512)
    refs = [t.model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    for label, drafter, kw in (("oracle", TreeOracle(t, TREE["depth"]), {"tree": TREE}), ("eagle3", head, {"tree": TREE}),
                               ("lookup", None, {"prompt_lookup": 4}), ("draft model", draft, {"gamma": 3})):
        out = decode.generate(t, drafter, torch.tensor([REPEATS]), NEW, eos_token_id=False, **kw)
        want = t.model.generate(torch.tensor([REPEATS]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(REPEATS):].tolist()
        assert out.sequences[0, len(REPEATS):].tolist() == want, (name, label)
        if label == "oracle":
            assert max(out.stats.accept_lengths) == TREE["depth"] + 1, out.stats.accept_lengths
    batch = decode.generate(t, [TreeOracle(t, TREE["depth"]) for _ in PROMPTS], PROMPTS, NEW, eos_token_id=False,
                            tree=TREE)
    assert batch.sequences[:, max(map(len, PROMPTS)):].tolist() == refs, name


def test_indexed_attention_check_can_fail(monkeypatch):
    """The comparison above can fail: when the kept nodes' indexer keys are not moved with their keys, the indexer
    scores stale keys and the output leaves the target's."""
    from eaglekit.target import RowsLayer

    t = target("deepseek_v32")
    ids = torch.tensor([PROMPTS[0]])
    ref = t.model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    monkeypatch.setattr(RowsLayer, "buffers", lambda self: ["keys", "values"])
    out = decode.generate(t, TreeOracle(t, TREE["depth"]), ids, NEW, eos_token_id=False, tree=TREE)
    assert out.sequences.tolist() != ref.tolist()


def test_family_chain_check_can_fail(monkeypatch):
    """The comparison above can fail: without the rollback (crop a no-op) the rejected nodes stay in the
    recurrent state and the oracle's output leaves the target's."""
    from transformers.cache_utils import Cache

    t = target("qwen3_5_text")
    ids = torch.tensor([PROMPTS[0]])
    ref = t.model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    t.chain_refusal()  # its check runs once, with the real crop
    monkeypatch.setattr(Cache, "crop", lambda self, n: None)
    out = decode.generate(t, GreedyChain(t, depth=4, wrong=2), ids, NEW, eos_token_id=False)
    assert out.sequences.tolist() != ref.tolist()


@pytest.mark.parametrize("name,why", [("deepseek_v4", "DeepseekV4CSACache, DeepseekV4HCACache cannot be rolled back")])
def test_family_speculative_decoding_is_refused_before_any_token(name, why):
    """Where the model's own cache cannot be cropped (DeepSeek-V4), every drafter is refused before the first token,
    with the reason."""
    t = target(name)
    head = build_head(HeadConfig.from_target(t, kind="eagle3"), t)
    for drafter, lookup in ((head, 0), (None, 3), (GreedyChain(t, depth=4, wrong=2), 0)):
        streamer = Recorder()
        with pytest.raises(UnsupportedArchitecture, match="speculative decoding refused: .*" + why) as e:
            decode.generate(t, drafter, torch.tensor([PROMPTS[0]]), NEW, streamer=streamer, prompt_lookup=lookup)
        assert streamer.got == [] and "plain decoding" in str(e.value)


TREED = [n for n in CHAINED if n != "jamba"]  # Jamba's Mamba layers are Mamba's (its path rows run 20 s)


@pytest.mark.parametrize("name", TREED)
def test_family_trees_decode_as_the_target_does(name):
    """Trees on the model's own cache, one batch row per root-to-leaf path: an oracle's binary trees (every step
    accepts its second children, so the kept row is not the first path), an EAGLE-3 head's tree with a prompt-lookup
    branch, a draft model's tree, each giving transformers' greedy tokens."""
    from helpers import tiny_target

    from eaglekit.decode.draft_model import ModelTreeDrafter
    from eaglekit.decode.drafters import TreeSpec

    t = target(name)
    head = build_head(HeadConfig.from_target(t, kind="eagle3"), t)
    draft = tiny_target("llama", layers=1, vocab_size=512)
    ids = torch.tensor([REPEATS])
    ref = t.model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(REPEATS):].tolist()
    for label, drafter, kw in (("oracle", TreeOracle(t, TREE["depth"]), {"tree": TREE}),
                               ("eagle3 + lookup", head, {"tree": TREE, "prompt_lookup": 4}),
                               ("draft model's tree", ModelTreeDrafter(t, draft, TreeSpec(2, 2, 4)), {})):
        out = decode.generate(t, drafter, ids, NEW, eos_token_id=False, **kw)
        assert out.sequences[0, len(REPEATS):].tolist() == ref, (name, label)
        if label == "oracle":
            assert max(out.stats.accept_lengths) == TREE["depth"] + 1, out.stats.accept_lengths
    out = decode.generate(t, head, ids, NEW, eos_token_id=False)  # a head's default there: a chain
    assert max(out.stats.tree_sizes) == 5 and out.stats.new_tokens == NEW


def test_family_tree_check_can_fail(monkeypatch):
    """The comparison above can fail: keeping the first path's row instead of the accepted node's leaves the
    target's output (the oracle accepts the second child at every depth)."""
    from eaglekit.decode import loop

    t = target("qwen3_5_text")
    ids = torch.tensor([PROMPTS[0]])
    ref = t.model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    def first_row(cache, paths, accepted):
        cache.crop(-(max(map(len, paths)) - len(accepted)))
        cache.reorder_cache(torch.tensor([0]))

    monkeypatch.setattr(loop, "keep_path", first_row)
    out = decode.generate(t, TreeOracle(t, TREE["depth"]), ids, NEW, eos_token_id=False, tree=TREE)
    assert out.sequences.tolist() != ref.tolist()


def test_refusals_name_the_kind_of_layer():
    assert "recurrent state (layer type linear_attention)" in refusal(target("qwen3_5_text").config)
    assert "chunked_attention layers" in refusal(target("llama4_text").config)  # trees: chains are verified
    assert all(refusal(target(n).config) is None for n in INDEXED)  # DSA: trees on eaglekit's cache


# ---- VL checkpoints of Qwen3.5's class -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen35-vl")
    tiny_vl_model().save_pretrained(path)
    tiny_tokenizer(512).save_pretrained(path)
    return path


def test_vl_class_in_memory_taps_its_language_model():
    model = tiny_vl_model()
    t = Target(model, tiny_tokenizer(512), name="tiny-qwen3.5-vl")
    assert t.layers is model.model.language_model.layers and t.config is model.config.text_config
    assert t.lm_head is model.lm_head and t.num_layers == 4
    ids = torch.tensor([PROMPTS[0]])
    hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    feats = t.features(ids, layer_ids=(0, 3))
    torch.testing.assert_close(feats.taps[..., 64:], hs[3], rtol=0, atol=0)
    torch.testing.assert_close(t.lm_head(feats.last), model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_vl_checkpoint_loads_for_text_whole_and_without_its_decoder(vl_dir):
    whole = load_target(vl_dir)
    assert whole.model_config.architectures == ["Qwen3_5ForConditionalGeneration"]
    assert whole.config.model_type == "qwen3_5_text" and whole.num_layers == 4
    ids = torch.tensor([PROMPTS[1]])
    torch.testing.assert_close(whole.model(ids).logits, tiny_vl_model()(input_ids=ids).logits, rtol=0, atol=0)
    borrowed = load_target(vl_dir, decoder=False)  # the checkpoint's model.language_model.* names, read by suffix
    for a, b in ((whole.embed_tokens, borrowed.embed_tokens), (whole.lm_head, borrowed.lm_head)):
        torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)
    torch.testing.assert_close(whole.norm.weight, borrowed.norm.weight, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", TRAINED_KINDS)
def test_vl_checkpoint_trains_every_kind_on_text_conversations(vl_dir, kind, tmp_path):
    """The whole online path (load_target_from, capture in each step, held-out τ_sim, save, reload) on a VL
    checkpoint of Qwen3.5's class, for every kind with its default taps."""
    from eaglekit.export import load_head
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import train

    tiny_conversations(tmp_path / "convs.jsonl", n=10)
    cfg = load_train_config(None, [
        f"target={vl_dir}", f"data.conversations={tmp_path / 'convs.jsonl'}", "data.eval_samples=3",
        f"head.kind={kind}", "loss.ttt_steps=2", "data.batch_size=2", "optim.max_steps=2", "progress=false",
        "trackers=[]", "eval_interval=0", "save_interval=0", f"output_dir={tmp_path / 'out'}"])
    final = train(cfg)
    assert final["step"] == 2 and 1.0 <= final["eval_tau_sim"] <= 1.0 + cfg.loss.ttt_steps, final
    head = load_head(tmp_path / "out" / "final", load_target(vl_dir))
    assert all(torch.isfinite(p).all() for p in head.parameters())


# ---- defaults and errors ---------------------------------------------------------------------------------------
def test_dflash_default_taps_read_attention_layers_on_a_hybrid():
    """SpecForge's Qwen3.5 DFlash configs tap full-attention layers' outputs (target_layer_ids 3, 15, 31, 47, 59 of
    64); eaglekit's DFlash default does the same (a tap is a layer input: the output of the layer before it).
    EAGLE-3 keeps vLLM's (2, n//2, n-3), which vLLM's Qwen3.5 reads too."""
    t = hybrid_target()
    cfg = t.config
    full = [i for i, k in enumerate(cfg.layer_types) if k == "full_attention"]  # 3, 7, 11
    dflash = HeadConfig.from_target(t, kind="dflash").aux_layer_ids
    assert dflash == [4, 8] and all(tap - 1 in full for tap in dflash)  # (2, 6, 9) moved to 4, 8, 8
    assert HeadConfig.from_target(t, kind="eagle3").aux_layer_ids == [2, 6, 9]
    assert HeadConfig.from_target(t, kind="dflash", aux_layer_ids=[1, 2]).aux_layer_ids == [1, 2]  # config wins
    from helpers import tiny_target

    assert tiny_target("llama", layers=6).attention_taps((2, 3)) == (2, 3)  # attention everywhere: unchanged


def test_an_encoder_built_as_a_decoder_gets_one_clear_error():
    import transformers

    cfg = transformers.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, is_decoder=True)
    model = transformers.BertLMHeadModel(cfg)
    with pytest.raises(ValueError, match=r"its layers are an encoder's \(.*encoder\.layer\).*decoder-only"):
        Target(model, tiny_tokenizer(512), name="tiny-bert")


@pytest.mark.slow
def test_vl_checkpoint_prepare_offline_training_and_the_cli(vl_dir, tmp_path, capsys):
    """`eaglekit prepare` captures a VL checkpoint's text features (hooks), a head trains offline on them with the
    target read without its decoder, `eaglekit generate` decodes it plainly (transformers' greedy tokens) and with
    the head's chain and its tree, each printing plain decoding's text."""
    from eaglekit.cli import main
    from eaglekit.data_prep import FeatureDataset
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import train

    tiny_conversations(tmp_path / "convs.jsonl", n=10)
    prep = tmp_path / "prep"
    assert main(["prepare", f"target={vl_dir}", f"data={tmp_path / 'convs.jsonl'}", f"output_dir={prep}",
                 "num_conversations=0", "max_length=64", "draft_vocab_size=64", "progress=false"]) == 0
    ds = FeatureDataset(prep)
    assert len(ds) == 10 and ds[0]["taps"].shape[-1] == 3 * 64  # the default taps of a 4-layer target: (2, 2, 1)
    cfg = load_train_config(None, [
        f"target={vl_dir}", f"data.features_dir={prep}", "data.eval_samples=3", "data.batch_size=2",
        "loss.ttt_steps=2", "optim.max_steps=2", "progress=false", "trackers=[]", "eval_interval=0",
        "save_interval=0", f"output_dir={tmp_path / 'out'}"])
    final = train(cfg)
    assert final["step"] == 2 and 1.0 <= final["eval_tau_sim"] <= 3.0, final
    capsys.readouterr()
    assert main(["generate", f"target={vl_dir}", "prompt=abc", "max_new_tokens=6"]) == 0
    plain = capsys.readouterr().out
    t = load_target(vl_dir)
    ids = t.chat_ids("abc")
    ref = t.model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert decode.generate(t, None, ids, 6, eos_token_id=False).sequences.tolist() == ref.tolist()
    head = ["generate", f"target={vl_dir}", f"head={tmp_path / 'out' / 'final'}", "prompt=abc", "max_new_tokens=6"]
    assert main(head) == 0  # the head's chain (no lookup branch by default on a recurrent target)
    chain = capsys.readouterr()
    assert "tau=" in chain.err and chain.out == plain
    assert main([*head, "tree=3,2,6"]) == 0  # a tree: one verify row per path
    assert capsys.readouterr().out == plain


def hybrid_target(blocks: int = 3) -> Target:
    """A tiny Qwen3.5 of ``blocks`` x (3 Gated DeltaNet layers, 1 full-attention layer): attention at 3, 7, 11."""
    import transformers
    from arch_matrix import BASE, GDN

    types = (["linear_attention"] * 3 + ["full_attention"]) * blocks
    cfg = transformers.Qwen3_5TextConfig(**{**BASE, **GDN, "num_hidden_layers": len(types), "layer_types": types,
                                            "architectures": ["Qwen3_5ForConditionalGeneration"]})
    torch.manual_seed(0)
    return Target(transformers.Qwen3_5ForCausalLM(cfg).eval(), tiny_tokenizer(512), name="tiny-qwen3.5-12")


def test_hybrid_exports_carry_the_taps_the_engines_read(tmp_path):
    """vLLM's EAGLE-3 on Qwen3.5 reads the layers (2, n//2, n-3) it names; a DFlash export on a hybrid names its
    attention layers' outputs as target_layer_ids, read back by each engine's rule as the head's taps."""
    from eaglekit.export import load_head
    from eaglekit.export.dflash_layout import DFLASH_ENGINES, engine_taps
    from eaglekit.export.engines import ENGINES, read_taps
    from eaglekit.export.formats import export_head

    t = hybrid_target()
    eagle3 = build_head(HeadConfig.from_target(t, kind="eagle3"), t)
    out = export_head(eagle3, tmp_path / "e3", "vllm", verifier_architectures=t.config.architectures,
                      verifier="org/tiny-qwen3.5")
    config = json.loads((out / "config.json").read_text())
    assert read_taps(config, ENGINES["vllm"]) == [2, 6, 9] == list(eagle3.taps)
    dflash = build_head(HeadConfig.from_target(t, kind="dflash", num_layers=1, block_size=4), t)
    for layout in ("vllm", "sglang"):
        out = export_head(dflash, tmp_path / f"dflash-{layout}", layout)
        config = json.loads((out / "config.json").read_text())
        assert config["dflash_config"]["target_layer_ids"] == [3, 7]  # the full-attention layers
        assert engine_taps(config, DFLASH_ENGINES[layout]) == list(dflash.taps) == [4, 8]
        assert load_head(out, t).taps == dflash.taps


def test_layers_that_carry_another_stream_layout_get_one_clear_error():
    """XLNet's layers see [S, B, H]: a tap that is not one row per token is refused by name, not read as one."""
    import transformers

    cfg = transformers.XLNetConfig(vocab_size=512, d_model=64, n_layer=2, n_head=4, d_inner=128)
    t = Target(transformers.XLNetLMHeadModel(cfg).eval(), tiny_tokenizer(512), name="tiny-xlnet")
    with pytest.raises(ValueError, match=r"layer 0's input is \[12, 2, 64\] for token ids \[2, 12\].*stream layout"):
        t.features(torch.randint(7, 512, (2, 12)), layer_ids=(0,))
