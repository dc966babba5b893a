"""A target whose lm_head has a bias (Phi-1/1.5/2, GPT-J: logits = last @ W.T + b), checked against the
target's own logits: the teacher's argmax and draft-vocabulary distribution (cached and recomputed), the
rows offline training keeps, a DFlash head's logits through the shared lm_head, and the exports that would
carry the lm_head's rows without it."""
import pytest
import torch
from helpers import tiny_conversations, tiny_tokenizer

from eaglekit.heads import HeadConfig, build_head
from eaglekit.heads.objectives import Teacher, teacher_argmax, teacher_probs
from eaglekit.target import Target
from eaglekit.target.borrowed import keep_rows

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest
V, VD = 64, 40


def tiny_phi(bias_std: float = 2.0, seed: int = 0):
    """A tiny random PhiForCausalLM (its lm_head has a bias), the bias drawn with std ``bias_std``."""
    from transformers import AutoModelForCausalLM, PhiConfig

    torch.manual_seed(seed)
    cfg = PhiConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                    max_position_embeddings=128, pad_token_id=0, eos_token_id=6, bos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.bias.normal_(0.0, bias_std)
    return model


def _target(bias_std: float = 2.0) -> Target:
    return Target(tiny_phi(bias_std), tiny_tokenizer(V), name="tiny-phi")


def _draft_vocab(seed: int = 0):
    keep = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    return keep, t2d


def _own_logits(target, n: int = 24):
    ids = torch.randint(7, V, (2, n), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return target.features(ids).last, target.model(ids).logits


def test_the_teacher_reads_the_lm_head_bias():
    """The teacher's argmax and its draft-vocabulary distribution (cached per batch, or recomputed from the
    hidden state) are the target's own; without the bias its argmax would miss most positions."""
    target = _target()
    last, logits = _own_logits(target)
    keep, t2d = _draft_vocab()
    teacher = Teacher.of(target.lm_head, t2d)
    want = logits.argmax(-1)
    assert float((teacher_argmax(last, target.lm_head.weight) == want).float().mean()) < 0.5  # the bias matters
    inside = t2d[want]
    assert inside.any() and (~inside).any()
    top = teacher.targets(last, chunk=5)
    assert (top[~inside] == -1).all() and torch.equal(keep[top[inside]], want[inside])
    p_want = torch.softmax(logits[..., keep], -1)
    for cache_mb in (64.0, 0.0):
        source, weight = teacher.source(last, 5, cache_mb)
        assert (weight is None) == (cache_mb > 0)
        p = source if weight is None else teacher_probs(source, weight, 5)
        torch.testing.assert_close(p, p_want, rtol=1e-5, atol=1e-6)


def test_an_unbiased_teacher_is_unchanged():
    """An lm_head without bias: no bias read, the teacher's source is the hidden state and rows themselves."""
    from helpers import tiny_target

    target = tiny_target("llama", layers=4, vocab_size=V)
    _, t2d = _draft_vocab()
    teacher = Teacher.of(target.lm_head, t2d)
    last = torch.randn(2, 5, 32)
    source, weight = teacher.source(last, 4, 0.0)
    assert teacher.bias is None and teacher.draft_bias is None and source is last and weight is teacher.draft_weight


@pytest.mark.parametrize("kept", [False, True])  # the whole lm_head, or the rows offline training keeps
def test_dflash_logits_through_a_biased_lm_head_are_the_targets(kept):
    """A DFlash head drafts through the target's lm_head rows: given the target's last hidden state its
    logits are the target's own at the draft vocabulary, bias included — also from the kept rows."""
    target = _target()
    last, logits = _own_logits(target)
    keep, t2d = _draft_vocab()
    torch.manual_seed(0)
    head = build_head(HeadConfig.from_target(target, kind="dflash", num_layers=1, block_size=3,
                                             draft_vocab_size=VD), target)
    head.set_draft_vocab(keep - torch.arange(VD), t2d)
    if kept:
        keep_rows(target, torch.arange(V), keep[:-1].tolist() + [int(keep[-1])])
        head.bind(target)
        assert target.lm_head.row_bias is not None
        with pytest.raises(AttributeError, match="not all of it"):
            target.lm_head.bias  # noqa: B018  (the whole bias is gone too: never a short one read as whole)
    torch.testing.assert_close(head.logits(last), logits[..., keep], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def biased_capture(tmp_path_factory):
    from eaglekit.config import load_config
    from eaglekit.data_prep.prepare import PrepareConfig, run_prepare

    d = tmp_path_factory.mktemp("phi")
    tiny_phi().save_pretrained(d / "tiny")
    tiny_tokenizer(V).save_pretrained(d / "tiny")
    tiny_conversations(d / "convs.jsonl", n=10)
    run_prepare(load_config(PrepareConfig, None, [f"target={d / 'tiny'}", f"data={d / 'convs.jsonl'}",
                                                  f"output_dir={d / 'feats'}", f"draft_vocab_size={VD}",
                                                  "progress=false"]))
    return d


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_offline_training_on_a_biased_target_keeps_the_bias_rows(biased_capture, tmp_path, kind):
    """Offline training with only the kept rows (the default) takes the whole target's steps on a biased
    target: the kept lm_head rows carry their bias, in the teacher and in DFlash's shared lm_head."""
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import build_trainer

    d, runs = biased_capture, {}
    for name, extra in (("rows", []), ("whole", ["data.load_target_decoder=true"])):
        trainer = build_trainer(load_train_config(None, [
            f"target={d / 'tiny'}", f"data.features_dir={d / 'feats'}", "data.eval_samples=2", f"head.kind={kind}",
            f"head.draft_vocab_size={VD}", "loss.ttt_steps=2", "data.batch_size=2", "progress=false",
            "trackers=[]", "eval_interval=0", "save_interval=0", f"output_dir={tmp_path / name}", *extra]))
        try:
            runs[name] = trainer, [trainer.train_step([[0, 1]]), trainer.evaluate()]
        finally:
            trainer.lock.release()
    rows, whole = runs["rows"][0], runs["whole"][0]
    assert rows.target.has_decoder is False and rows.teacher.lm_head_weight is None
    assert rows.teacher.draft_bias is not None and whole.teacher.bias is not None
    assert [r.get("loss", r.get("eval_loss")) for r in runs["rows"][1]] == \
        [r.get("loss", r.get("eval_loss")) for r in runs["whole"][1]]


@pytest.mark.parametrize("kind,layout", [("dflash", "vllm"), ("dspark", "speculators")])
def test_exports_that_carry_a_biased_lm_head_are_refused_naming_the_bias(tmp_path, kind, layout):
    """vLLM's DFlash / DSpark load the draft vocabulary's lm_head as a weight alone: a head over a biased
    lm_head is refused before anything is written; over the whole vocabulary it carries no lm_head."""
    from eaglekit.export import export_head
    from eaglekit.export.dflash_layout import refuse_lm_head_bias
    from eaglekit.export.engines import ExportError

    target = _target()
    keep, t2d = _draft_vocab()
    head = build_head(HeadConfig.from_target(target, kind=kind, num_layers=1, block_size=3, draft_vocab_size=VD),
                      target)
    head.set_draft_vocab(keep - torch.arange(VD), t2d)
    with pytest.raises(ExportError, match="lm_head has a bias"):
        export_head(head, tmp_path / "out", layout, verifier="tiny-phi")
    assert not (tmp_path / "out").exists()
    full = build_head(HeadConfig.from_target(target, kind=kind, num_layers=1, block_size=3, draft_vocab_size=V),
                      target)
    refuse_lm_head_bias(full)  # no lm_head in its export: nothing to refuse
