"""P-EAGLE through the trainer on a tiny target: a few epochs of online features raise held-out τ_sim over
the same head untrained, offline features (an eagle3 capture) train it too, and the trained head decodes
token-identically to the target's own greedy decoding while accepting more than the untrained one.
(The objective itself is checked against a naive reference in tests/heads/test_heads_parallel.py.)"""
import pytest
import torch
from helpers import save_tiny, tiny_conversations

from eaglekit import decode
from eaglekit.export import load_head

pytestmark = pytest.mark.usefixtures("one_thread")


def _overrides(tmp_path, name, *extra):
    return [f"target={tmp_path / 'tiny'}", "data.eval_samples=6", "head.kind=peagle", "head.block_size=3",
            "head.num_layers=2", "head.draft_vocab_size=64", "head.init_from_target=true", "loss.ttt_steps=3", "data.batch_size=4",
            "progress=false", "trackers=[]", "eval_interval=0", "save_interval=0", f"output_dir={tmp_path / name}",
            *extra]


def test_peagle_trained_a_few_steps_beats_untrained_and_decodes_exactly(tmp_path):
    from eaglekit.target import load_target
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import train

    save_tiny(tmp_path / "tiny", vocab_size=64, hidden=32, layers=4)
    convs = f"data.conversations={tiny_conversations(tmp_path / 'convs.jsonl', n=40)}"
    untrained = train(load_train_config(None, _overrides(tmp_path, "untrained", convs, "optim.lr=0",
                                                         "optim.max_steps=1")))
    trained = train(load_train_config(None, _overrides(tmp_path, "trained", convs, "optim.lr=5e-3",
                                                       "optim.epochs=15")))
    assert trained["step"] > untrained["step"]
    assert trained["eval_tau_sim"] > untrained["eval_tau_sim"] + 0.1, (trained, untrained)
    assert trained["eval_acc_1"] > untrained["eval_acc_1"]  # the mask slots learned too, not only depth 1

    tiny = load_target(tmp_path / "tiny")
    head = load_head(tmp_path / "trained" / "final", tiny)
    assert head.config.kind == "peagle" and head.draft_depths == 3
    prompt = tiny.tokenizer("hello world", return_tensors="pt")["input_ids"][:, :6]
    ref = tiny.model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    taus = {}
    for name, h in (("trained", head), ("untrained", load_head(tmp_path / "untrained" / "final", tiny))):
        out = decode.generate(tiny, h, prompt, 24, tree={"depth": 3, "top_k": 1, "total_tokens": 3},
                              eos_token_id=False)
        assert torch.equal(out.sequences, ref), name
        taus[name] = out.stats.tau
    assert taus["trained"] > taus["untrained"], taus


def test_peagle_trains_offline_on_an_eagle3_capture(tmp_path):
    """P-EAGLE reads EAGLE-3's taps, so one capture made for eagle3 trains it."""
    from eaglekit.data_prep import capture_features, read_conversations, tokenize_conversations
    from eaglekit.target import load_target
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import train

    save_tiny(tmp_path / "tiny", vocab_size=64, hidden=32, layers=4)
    tiny = load_target(tmp_path / "tiny")
    samples, _ = tokenize_conversations(tiny.tokenizer, read_conversations(tiny_conversations(tmp_path / "c.jsonl",
                                                                                              n=12)), 64)
    capture_features(tiny, samples, tmp_path / "feats", kind="eagle3", progress=False)
    final = train(load_train_config(None, _overrides(tmp_path, "out", f"data.features_dir={tmp_path / 'feats'}",
                                                     "optim.max_steps=3", "data.eval_samples=3")))
    assert final["step"] == 3 and {"eval_acc_0", "eval_acc_1", "eval_acc_2", "eval_tau_sim"} <= set(final)
    head = load_head(tmp_path / "out" / "final", tiny)
    assert head.config.kind == "peagle" and head.config.block_size == 3 and head.taps == tuple(tiny.default_taps)
    # head.train_embedding: offline too (the target's embedding read alone), the head's copy trained and saved
    train(load_train_config(None, _overrides(tmp_path, "emb", f"data.features_dir={tmp_path / 'feats'}",
                                             "optim.max_steps=3", "data.eval_samples=3", "head.train_embedding=true",
                                             "optim.lr=5e-3")))
    own = load_head(tmp_path / "emb" / "final", tiny)
    moved = (own.embed_tokens.weight - tiny.embed_tokens.weight).abs().max()
    assert own.config.train_embedding and moved > 1e-3, moved
    assert "embed_tokens" not in head._modules  # off: it reads the target's, saves none
