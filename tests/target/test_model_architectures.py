"""The architecture matrix (tests/arch_matrix.py): for a tiny random model of each supported architecture,
taps equal ``output_hidden_states``, two online training steps give a finite loss, greedy tree decoding with an
untrained EAGLE-3 head (and with an oracle tree whose nodes are accepted) equals the target's own greedy
decoding for prompts longer than every sliding window, alone and as a batch of 2, and each export layout is
written where its engines can serve that architecture and refused, naming the engine, where not. The families the
loop does not yet verify drafts on are tests/target/test_families.py's; docs/inputs.md's table is the matrix's.
"""
import json
import re
from pathlib import Path

import pytest
import torch
from arch_matrix import MATRIX, WINDOW, readme_block, tiny_model, tiny_target_of
from helpers import TreeOracle, tiny_tokenizer

from eaglekit import decode
from eaglekit.export.engines import ENGINES, LAYOUT_ENGINES
from eaglekit.export.formats import ExportError, export_head
from eaglekit.heads import HeadConfig, build_head
from eaglekit.heads.objectives import Teacher
from eaglekit.target import Target, load_target
from eaglekit.train.config import LossConfig

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]
NEW = 12  # new tokens per decode
TREE = {"depth": 3, "top_k": 3, "total_tokens": 8}
_gen = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(7, 512, (n,), generator=_gen).tolist() for n in (20, 13)]  # both longer than WINDOW
target = tiny_target_of


def head_for(t: Target, seed: int = 0):
    torch.manual_seed(seed)
    return build_head(HeadConfig.from_target(t, kind="eagle3", aux_layer_ids=[0, 1]), t)


def hf_greedy(t: Target, ids: list[int]) -> list[int]:
    out = t.model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_matrix_prompts_pass_every_window():
    assert min(map(len, PROMPTS)) > WINDOW
    windows = {n: target(n).attention_windows for n in ("mistral", "gemma2", "gpt_oss", "gemma3")}
    assert all(w.get("sliding_attention") == WINDOW for w in windows.values()), windows


@pytest.mark.parametrize("name", MATRIX)
def test_taps_equal_output_hidden_states(name):
    t = target(name)
    ids = torch.tensor([PROMPTS[0]])
    feats = t.features(ids, layer_ids=(0, 1))
    ref = t.model(ids, output_hidden_states=True).hidden_states
    H = t.hidden_size
    for k in (0, 1):
        torch.testing.assert_close(feats.taps[..., k * H:(k + 1) * H], ref[k], rtol=0, atol=0)
    torch.testing.assert_close(feats.last, ref[-1], rtol=0, atol=0)


@pytest.mark.parametrize("name", MATRIX)
def test_two_online_training_steps(name):
    """Online: the target's taps computed inside each step, the head's TTT loss, an optimizer step."""
    t = target(name)
    head = head_for(t).train()
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    teacher = Teacher.build(t.lm_head.weight, head.t2d)
    ids = torch.tensor([PROMPTS[0][:16], PROMPTS[1] + PROMPTS[0][:3]])
    before = [p.detach().clone() for p in head.parameters()]
    for _ in range(2):
        out = t.features(ids, layer_ids=head.taps)
        batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "last": out.last, "taps": out.taps}
        loss, stats = head.training_loss(teacher, batch, LossConfig(ttt_steps=2), steps=2)
        assert torch.isfinite(loss) and loss > 0, (name, loss)
        opt.zero_grad()
        (loss / sum(stats.total)).backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in head.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, head.parameters())), "the steps changed nothing"


@pytest.mark.parametrize("name", MATRIX)
def test_greedy_tree_decoding_equals_the_targets_own(name):
    t = target(name)
    refs = [hf_greedy(t, p) for p in PROMPTS]
    head = head_for(t)
    oracle = [TreeOracle(t, TREE["depth"]) for _ in PROMPTS]
    for ids, ref, orc in zip(PROMPTS, refs, oracle):
        for what, dr in (("head", head), ("oracle", orc)):
            out = decode.generate(t, dr, torch.tensor([ids]), NEW, eos_token_id=False, tree=TREE)
            assert out.sequences[0, len(ids):].tolist() == ref, (name, what, len(ids))
            if what == "oracle":  # every node it drafts on the target's path is accepted: the tree rows decide
                assert max(out.stats.accept_lengths) == TREE["depth"] + 1, out.stats.accept_lengths
    oracle = [TreeOracle(t, TREE["depth"]) for _ in PROMPTS]
    for what, dr in (("head", head), ("oracle", oracle)):
        out = decode.generate(t, dr, PROMPTS, NEW, eos_token_id=False, tree=TREE)
        width = max(map(len, PROMPTS))
        assert out.sequences[:, width:].tolist() == refs, (name, what, "batch of 2")


@pytest.mark.parametrize("name", ["mistral", "gpt_oss"])
def test_the_window_is_what_keeps_decoding_exact(name, monkeypatch):
    """The check above can fail: tree masks that ignore the sliding window part from the target's output."""
    t = target(name)
    ref = hf_greedy(t, PROMPTS[0])
    monkeypatch.setattr(t, "attention_windows", {k: None for k in t.attention_windows})
    out = decode.generate(t, TreeOracle(t, TREE["depth"]), torch.tensor([PROMPTS[0]]), NEW,
                          eos_token_id=False, tree=TREE)
    assert out.sequences[0, len(PROMPTS[0]):].tolist() != ref


@pytest.mark.parametrize("name", MATRIX)
def test_export_where_an_engine_serves_the_architecture(name, tmp_path):
    t, arch = target(name), MATRIX[name].model_class
    head = head_for(t)
    for layout in ("vllm", "sglang", "speculators"):
        engines = [ENGINES[e] for e in LAYOUT_ENGINES[layout]]
        refusing = [e for e in engines if e.targets and arch not in e.targets]
        kw = {"verifier_architectures": [arch], "verifier": "org/tiny-model"}
        if refusing:
            with pytest.raises(ExportError, match=re.escape(refusing[0].version) + f".*{arch}"):
                export_head(head, tmp_path / layout, layout, **kw)
            assert not (tmp_path / layout).exists()
        else:
            out = export_head(head, tmp_path / layout, layout, **kw)
            assert json.loads((out / "config.json").read_text())["architectures"]


def test_export_refusals_name_the_engines():
    """Some matrix rows are refused by each engine, some served (the table is not all 'yes')."""
    for engine in ("vllm", "sglang"):
        served = {n for n, a in MATRIX.items() if a.model_class in ENGINES[engine].targets}
        assert {"llama", "qwen3_moe", "gpt_oss", "deepseek_v3"} <= served < set(MATRIX), (engine, served)


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss", "qwen3"])
def test_load_target_picks_eager_where_a_model_has_no_sdpa(name, tmp_path):
    """Asked for SDPA (the default), load_target loads a model without an SDPA path eagerly (transformers 5.24:
    Gemma-2, gpt-oss; 5.17 has SDPA for Gemma-2) instead of failing."""
    tiny_model(name).save_pretrained(tmp_path)
    tiny_tokenizer(512).save_pretrained(tmp_path)
    t = load_target(tmp_path)
    assert t.model.config._attn_implementation == ("sdpa" if type(t.model)._supports_sdpa else "eager")
    ids = torch.tensor([PROMPTS[0]])
    torch.testing.assert_close(t.model(ids).logits, target(name).model(ids).logits, rtol=0, atol=0)


def test_online_training_run_on_a_sliding_window_moe_target(tmp_path):
    """The whole online path (train: load_target_from, capture in the step, evaluation, saving) on gpt-oss."""
    from helpers import tiny_conversations

    from eaglekit.export import load_head
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import train

    tiny_model("gpt_oss").save_pretrained(tmp_path / "tiny")
    tiny_tokenizer(512).save_pretrained(tmp_path / "tiny")
    tiny_conversations(tmp_path / "convs.jsonl", n=12)
    cfg = load_train_config(None, [
        f"target={tmp_path / 'tiny'}", f"data.conversations={tmp_path / 'convs.jsonl'}", "data.eval_samples=4",
        "head.kind=eagle3", "head.aux_layer_ids=[0,1]", "loss.ttt_steps=2", "data.batch_size=2", "optim.max_steps=2",
        "progress=false", "trackers=[]", "eval_interval=0", "save_interval=0", f"output_dir={tmp_path / 'out'}"])
    final = train(cfg)
    assert final["step"] == 2 and 1.0 <= final["eval_tau_sim"] <= 3.0, final
    head = load_head(tmp_path / "out" / "final", load_target(tmp_path / "tiny"))
    assert all(torch.isfinite(p).all() for p in head.parameters())


# ---- docs/inputs.md ------------------------------------------------------------------------------------------
def test_readme_table_is_the_matrix():
    readme = (ROOT / "docs" / "inputs.md").read_text()
    assert readme_block() in readme, "docs/inputs.md's architectures table differs: run python scripts/arch_table.py"
