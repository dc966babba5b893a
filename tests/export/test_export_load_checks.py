"""What a head file claims is checked when it loads, for every layout (native, vLLM, SGLang, speculators, and a
DFlash head's vLLM layout): each damage a broken or hand-edited file shows — a vocabulary map in the wrong
convention, out of range, not one-to-one, not inverse of its mask, of the wrong dtype or length, a config size that
disagrees with the tensors, a tap past the target's layers, a non-finite weight — is refused by ``load_head`` with
one error naming the file and the tensor or field, and by ``eaglekit export`` with exit 2. The undamaged file
loads (so each refusal is the damage's)."""
import json
import shutil

import pytest
import torch
from helpers import random_draft_vocab, save_tiny
from safetensors.torch import load_file, save_file

from eaglekit.export import export_head, load_head
from eaglekit.heads import HeadConfig, build_head
from eaglekit.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")
V, VD = 64, 16


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = save_tiny(tmp_path_factory.mktemp("target") / "tiny", layers=8, hidden=32, vocab_size=V)
    return load_target(folder)


def head_of(target, kind="eagle3"):
    torch.manual_seed(0)
    kw = {"block_size": 4, "num_layers": 1} if kind == "dflash" else {}
    head = build_head(HeadConfig.from_target(target, kind=kind, draft_vocab_size=VD, **kw), target)
    random_draft_vocab(head, VD)
    return head


def saved(target, tmp_path, layout, kind="eagle3"):
    head = head_of(target, kind)
    if layout == "native":
        head.save_pretrained(tmp_path / layout)
        return tmp_path / layout
    return export_head(head, tmp_path / layout, layout, verifier="org/tiny")


def edit_weights(path, fn):
    f = path / "model.safetensors"
    state = load_file(str(f))
    fn(state)
    save_file(state, str(f))


def edit_config(path, fn):
    f = path / "config.json"
    config = json.loads(f.read_text())
    fn(config)
    f.write_text(json.dumps(config))


def absolute(s):
    s["d2t"] = torch.arange(VD) + s["d2t"]  # the target ids themselves


def past_vocab(s):
    s["d2t"][-1] = V + 5 - (VD - 1)


def duplicate(s):
    s["d2t"][1] = s["d2t"][0] - 1  # draft id 1 lands on draft id 0's target id


def not_inverse(s):
    t = s["t2d"].clone()
    first, free = int(t.nonzero()[0]), int((~t).nonzero()[0])
    t[first], t[free] = False, True
    s["t2d"] = t


def short_d2t(s):
    s["d2t"] = s["d2t"][:-1]


def float_d2t(s):
    s["d2t"] = s["d2t"].float()


def negative(s):
    s["d2t"][0] = -1


def nan_weight(s):
    name = next(k for k, v in s.items() if v.is_floating_point())
    s[name] = s[name].clone()
    s[name].view(-1)[0] = float("nan")


WEIGHT_DAMAGES = {
    "d2t absolute ids": (absolute, r"'d2t' holds absolute target ids, not offsets"),
    "d2t past the vocabulary": (past_vocab, r"'d2t' maps 1 draft id\(s\) outside the target vocabulary 0\.\.63"),
    "two draft ids on one target id": (duplicate, r"'d2t' maps two draft ids \(0 and 1\) to one target id"),
    "t2d not d2t's inverse": (not_inverse, r"'t2d' is not d2t's inverse|'t2d' marks"),
    "d2t shorter than the draft vocabulary": (short_d2t, r"'d2t' has shape \[15\]|d2t: \[15\] int64 \(expected \[16\]"),
    "d2t of floats": (float_d2t, r"'d2t' is torch.float32, expected integer offsets|d2t: \[16\] float \(expected \[16\] int64\)"),
    "a negative target id": (negative, r"'d2t' maps 1 draft id\(s\) outside the target vocabulary"),
    "a NaN weight": (nan_weight, r"holds 1 non-finite value"),
}
LAYOUTS = ["native", "vllm", "sglang", "speculators"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_damaged_tensor_is_refused_naming_the_file_and_tensor(target, tmp_path, layout):
    path = saved(target, tmp_path, layout)
    assert load_head(path, target).d2t.abs().sum() > 0  # the undamaged file loads, with real offsets
    for what, (damage, message) in WEIGHT_DAMAGES.items():
        bad = tmp_path / f"bad-{layout}-{what.replace(' ', '-')}"
        shutil.copytree(path, bad)
        edit_weights(bad, damage)
        with pytest.raises(ValueError, match=message) as e:
            load_head(bad, target)
        assert str(bad / "model.safetensors") in str(e.value), (layout, what, str(e.value))


def draft_vocab_field(config):
    config["draft_vocab_size"] = VD * 2


def tap_past_the_layers(config):
    for c in (config, config.get("eagle_config") or {}, config.get("eaglekit") or {}):
        for key in ("aux_layer_ids", "eagle_aux_hidden_state_layer_ids"):
            if key in c:
                c[key] = [*c[key][:-1], 9]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("damage,message", [
    (draft_vocab_field, r"draft_vocab_size"),
    (tap_past_the_layers, r"(taps|aux_layer_ids).*9"),
])
def test_config_fields_that_disagree_with_the_tensors_are_refused(target, tmp_path, layout, damage, message):
    path = saved(target, tmp_path, layout)
    edit_config(path, damage)
    with pytest.raises(ValueError, match=message) as e:
        load_head(path, target)
    assert str(path) in str(e.value)


def test_a_dflash_export_with_a_damaged_map_is_refused(target, tmp_path):
    path = saved(target, tmp_path, "vllm", kind="dflash")
    assert load_head(path, target).config.draft_vocab_size == VD
    edit_weights(path, absolute)
    with pytest.raises(ValueError, match="'d2t' holds absolute target ids"):
        load_head(path, target)


def test_the_cli_exits_2_with_one_line(target, tmp_path, capsys):
    from eaglekit.cli import main

    path = saved(target, tmp_path, "vllm")
    edit_weights(path, duplicate)
    rc = main(["export", "--head", str(path), "--out", str(tmp_path / "again"), "--to", "sglang",
               "--target", target.name])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("eaglekit: error:")]
    assert rc == 2 and len(err) == 1 and "'d2t' maps two draft ids" in err[0], err
    assert not (tmp_path / "again").exists()
