"""Offline training without the target's decoder: load_target(decoder=False) reads the embedding, final norm and
lm_head by name (single file or sharded index, tied or not) and nothing else, refuses to run, and a run from
captured features takes the same steps as with the whole target loaded."""
import pytest
import torch
from helpers import save_tiny, tiny_conversations

from eaglekit.config import ConfigError
from eaglekit.target import load_target
from eaglekit.train.config import load_train_config
from eaglekit.train.trainer import build_trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest


@pytest.mark.parametrize("arch,shard", [("llama", None), ("qwen2", "40KB")])
def test_load_without_decoder_reads_the_borrowed_tensors_only(tmp_path, arch, shard):
    from helpers import tiny_model, tiny_tokenizer

    model = tiny_model(arch, 0, vocab_size=64, hidden=32, layers=4)  # llama: tied embeddings; qwen2: not
    model.save_pretrained(tmp_path / "m", **({"max_shard_size": shard} if shard else {}))
    tiny_tokenizer(64).save_pretrained(tmp_path / "m")
    assert (tmp_path / "m/model.safetensors.index.json").exists() == bool(shard)
    whole, part = load_target(tmp_path / "m"), load_target(tmp_path / "m", decoder=False)
    for name in ("embed_tokens", "lm_head", "norm"):
        assert torch.equal(getattr(part, name).weight, getattr(whole, name).weight), name
    assert (part.embed_tokens.weight is part.lm_head.weight) == (whole.embed_tokens.weight is whole.lm_head.weight)
    assert part.layers[0].mlp.down_proj.weight.is_meta and not part.lm_head.weight.is_meta
    assert part.fingerprint() == whole.fingerprint() and part.vocab_size == whole.vocab_size
    with pytest.raises(RuntimeError, match="without its decoder"):
        part.forward(torch.tensor([[1, 2]]))


def test_load_without_decoder_names_a_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path / "m", arch="qwen2", vocab_size=64, hidden=32, layers=2)
    state = load_file(tmp_path / "m/model.safetensors")
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, tmp_path / "m/model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(KeyError, match="'lm_head.weight'.*load it whole"):
        load_target(tmp_path / "m", decoder=False)


def _capture(d, rows: int = 64):
    """A tiny qwen2 target (its embedding ``rows`` long for the tokenizer's 64 ids: a padded vocabulary past
    64) and an EAGLE-3 capture of 12 conversations under ``d``."""
    from helpers import tiny_model, tiny_tokenizer

    from eaglekit.config import load_config
    from eaglekit.data_prep.prepare import PrepareConfig, run_prepare

    tiny_model("qwen2", 0, vocab_size=rows, hidden=32, layers=4).save_pretrained(d / "tiny")
    tiny_tokenizer(64).save_pretrained(d / "tiny")
    tiny_conversations(d / "convs.jsonl", n=12)
    run_prepare(load_config(PrepareConfig, None, [f"target={d / 'tiny'}", f"data={d / 'convs.jsonl'}",
                                                  f"output_dir={d / 'feats'}", "draft_vocab_size=32",
                                                  "progress=false"]))
    return d


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    return _capture(tmp_path_factory.mktemp("offline"))


def _trainer(d, out, *extra):
    return build_trainer(load_train_config(None, [
        f"target={d / 'tiny'}", f"data.features_dir={d / 'feats'}", "data.eval_samples=2", "head.kind=eagle3",
        "head.draft_vocab_size=32", "head.init_from_target=true", "loss.ttt_steps=2", "data.batch_size=2",
        "progress=false", "trackers=[]", "eval_interval=0", "save_interval=0", f"output_dir={out}", *extra]))


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "peagle", "dspark"])
def test_offline_training_without_the_decoder_takes_the_same_steps(capture, tmp_path, kind):
    """Whole target, borrowed modules whole (data.keep_target_rows=false) and borrowed rows only (the default:
    every item's teacher argmax computed ahead, then only the capture's embedding rows and the draft rows of
    lm_head kept): the same losses and weights, step for step."""
    from eaglekit.target.borrowed import RowSubset

    runs = {}
    for name, extra in (("rows", []), ("borrowed", ["data.keep_target_rows=false"]),
                        ("whole", ["data.load_target_decoder=true"])):
        trainer = _trainer(capture, tmp_path / name, f"head.kind={kind}", *extra)
        try:
            records = [trainer.train_step([[0, 1]]), trainer.train_step([[2, 3]]), trainer.evaluate()]
            runs[name] = (trainer, records, {k: v.detach().clone() for k, v in trainer.head.state_dict().items()})
        finally:
            trainer.lock.release()
    assert runs["rows"][0].target.has_decoder is False and runs["whole"][0].target.has_decoder is True
    losses = {name: [r.get("loss", r.get("eval_loss")) for r in run[1]] for name, run in runs.items()}
    assert losses["rows"] == losses["borrowed"] == losses["whole"], losses
    a, b = runs["rows"][2], runs["whole"][2]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # what the default kept: the capture's tokens (+ 0, the mask token) and the draft vocabulary's rows
    trainer = runs["rows"][0]
    emb, lm_head, whole = trainer.target.embed_tokens, trainer.target.lm_head, runs["whole"][0].target
    assert isinstance(emb, RowSubset) and isinstance(lm_head, RowSubset) and trainer.teacher.lm_head_weight is None
    source = trainer.src.train.source.source
    seen = torch.cat([source[i]["input_ids"] for i in range(len(source))]).unique()
    assert emb.rows.shape[0] < 64 and torch.equal(emb(seen), whole.embed_tokens.weight[seen])
    draft = torch.arange(32) + trainer.head.d2t
    assert lm_head.rows.shape[0] == 32 and torch.equal(lm_head(draft), whole.lm_head.weight[draft])
    assert trainer.teacher.draft_weight is lm_head.rows  # held once
    absent = min(set(range(64)) - set((emb.index >= 0).nonzero().flatten().tolist()))
    with pytest.raises(KeyError, match=f"token ids \\[{absent}\\] are not among the rows kept"):
        emb(torch.tensor([absent]))
    with pytest.raises(AttributeError, match="not all of it"):
        emb.weight  # noqa: B018  (reading the whole table fails, never reads a short one)


def test_load_target_decoder_false_refused_where_the_decoder_runs(tmp_path):
    with pytest.raises(ConfigError, match="load_target_decoder=false, but online features"):
        load_train_config(None, ["data.conversations=sharegpt", "data.load_target_decoder=false"])
    with pytest.raises(ConfigError, match="head.init_layer_from_target"):
        load_train_config(None, ["data.features_dir=x", "data.load_target_decoder=false",
                                 "head.init_layer_from_target=true"])


def test_offline_dflash_keeps_its_mask_row_past_the_tokenizer(tmp_path_factory, tmp_path):
    """A padded vocabulary (72 embedding rows, 64 token ids): DFlash's mask token is a spare row past them, which
    no capture holds, so the rows kept must add it (with the tiny tokenizer's pad-row mask, row 0, a lost mask
    row would pass unseen). Kept rows train as the whole target does, and the mask row is the target's."""
    d = _capture(tmp_path_factory.mktemp("padded"), rows=72)
    runs = {}
    for name, extra in (("rows", []), ("whole", ["data.load_target_decoder=true"])):
        trainer = _trainer(d, tmp_path / name, "head.kind=dflash", *extra)
        try:
            runs[name] = trainer, [trainer.train_step([[0, 1]]), trainer.evaluate()]
        finally:
            trainer.lock.release()
    trainer, whole = runs["rows"][0], runs["whole"][0].target
    mask = trainer.head.config.mask_token_id
    assert 64 <= mask < 72 == whole.embed_tokens.weight.shape[0]
    source = trainer.src.train.source.source
    assert mask not in torch.cat([source[i]["input_ids"] for i in range(len(source))]).tolist()
    assert torch.equal(trainer.target.embed_tokens(torch.tensor([mask])), whole.embed_tokens.weight[[mask]])
    assert [r.get("loss", r.get("eval_loss")) for r in runs["rows"][1]] == \
        [r.get("loss", r.get("eval_loss")) for r in runs["whole"][1]]
