"""The trainer's data: every batch names where its sequences came from (``batch["origin"]``), and a draft
vocabulary used with shards must be the one their manifest records."""
import pytest
import torch
from helpers import tiny_conversations, tiny_target

from eaglekit.config import ConfigError
from eaglekit.data_prep import build_draft_vocab, capture_features, save_draft_vocab, tokenize_conversations
from eaglekit.data_prep.vocab import vocab_record
from eaglekit.train.config import load_train_config
from eaglekit.train.data import collate, to_device
from eaglekit.train.sources import build_sources

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest
VOCAB = 20


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def capture(tmp_path_factory, target):
    """A small capture made like prepare makes it: shards, the vocabulary beside them, its hash recorded."""
    from eaglekit.data_prep import read_conversations

    d = tmp_path_factory.mktemp("integrity")
    convs = read_conversations(tiny_conversations(d / "convs.jsonl", n=12))
    samples, _ = tokenize_conversations(target.tokenizer, convs, 64)
    d2t, t2d = build_draft_vocab(samples, VOCAB, target.vocab_size)
    save_draft_vocab(d / "feats", d2t, t2d)
    capture_features(target, samples, d / "feats", shard_tokens=200, progress=False,
                     draft_vocab=vocab_record(d2t, t2d))
    top = torch.arange(target.vocab_size - VOCAB, target.vocab_size)  # same size, other tokens: the last ids
    other_t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    other_t2d[top] = True
    assert not torch.equal(other_t2d, t2d)
    save_draft_vocab(d / "other_vocab.safetensors", top - torch.arange(VOCAB), other_t2d)
    return d


def _cfg(*extra):
    return load_train_config(None, ["head.kind=eagle3", f"head.draft_vocab_size={VOCAB}", "data.eval_samples=2",
                                    "data.batch_size=3", *extra])


def test_collate_and_to_device_carry_origin_untouched():
    items = [{"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.long),
              "taps": torch.zeros(n, 6), "last": torch.zeros(n, 2), "origin": f"f/shard-00000.safetensors sample {n}"}
             for n in (3, 5)]
    batch = collate(items, "taps")
    assert batch["origin"] == ["f/shard-00000.safetensors sample 3", "f/shard-00000.safetensors sample 5"]
    moved = to_device(batch, "cpu", torch.bfloat16)
    assert moved["origin"] is batch["origin"] and moved["taps"].dtype == torch.bfloat16
    assert "origin" not in collate([{k: v for k, v in it.items() if k != "origin"} for it in items], "taps")


def test_offline_batches_name_shard_and_sample(capture, target):
    src = build_sources(_cfg(f"data.features_dir={capture / 'feats'}"), target)
    batch = collate(src.train.batch([0, 4]), "taps")
    files = [s["file"] for s in src.train.source.manifest["shards"]]
    assert all(o.startswith(str(capture / "feats" / "shard-")) for o in batch["origin"])
    want = [src.train.source.origin(i) for i in (0, 4)]
    assert batch["origin"] == want and want[0] == f"{capture / 'feats' / files[0]} sample 0"


def test_online_batches_name_the_conversations_file_and_item(capture, target):
    convs = capture / "convs.jsonl"
    src = build_sources(_cfg(f"data.conversations={convs}"), target)
    batch = collate(src.train.batch([2, 0]), "taps")
    assert batch["origin"] == [f"{convs} item 2 (id 2)", f"{convs} item 0 (id 0)"]


def test_a_vocabulary_beside_the_shards_that_is_not_the_recorded_one_is_refused(capture, target, tmp_path):
    import shutil

    feats = tmp_path / "feats"
    shutil.copytree(capture / "feats", feats)
    d2t = build_sources(_cfg(f"data.features_dir={feats}"), target).d2t  # the recorded one: accepted
    shutil.copy(capture / "other_vocab.safetensors", feats / "draft_vocab.safetensors")  # e.g. a refused prepare's
    with pytest.raises(ConfigError, match=rf"^{feats / 'draft_vocab.safetensors'}: draft vocabulary .* not the one "
                                          rf"{feats / 'manifest.json'} records"):
        build_sources(_cfg(f"data.features_dir={feats}"), target)
    shutil.copy(capture / "feats" / "draft_vocab.safetensors", feats / "draft_vocab.safetensors")
    assert torch.equal(build_sources(_cfg(f"data.features_dir={feats}"), target).d2t, d2t)


def test_an_explicit_vocabulary_that_is_not_the_recorded_one_is_used_with_a_warning(capture, target, capsys):
    other = capture / "other_vocab.safetensors"
    src = build_sources(_cfg(f"data.features_dir={capture / 'feats'}", f"data.draft_vocab={other}"), target)
    assert "warning" in capsys.readouterr().out
    from eaglekit.data_prep import load_draft_vocab

    assert torch.equal(src.d2t, load_draft_vocab(other)[0])


def test_collate_pads_only_what_the_head_reads():
    """An EAGLE-1 head (reads ``last``) gets no taps in its batch, even from EAGLE-3 features."""
    items = [{"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.long),
              "taps": torch.ones(n, 6), "last": torch.ones(n, 2), "top": torch.arange(n)} for n in (2, 4)]
    eagle3, eagle1 = collate(items, "taps"), collate(items, "last")
    assert set(eagle3) == {"input_ids", "loss_mask", "last", "taps", "top"}
    assert set(eagle1) == {"input_ids", "loss_mask", "last", "top"}
    assert eagle3["taps"].shape == (2, 4, 6) and eagle3["taps"][0, 2:].abs().sum() == 0  # right-padded
    assert eagle1["top"][0].tolist() == [0, 1, -1, -1]
