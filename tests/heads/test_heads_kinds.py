"""What differs between EAGLE-1 and EAGLE-3 is answered by the head classes (one registry): their taps,
the target feature they read, their fusion, draft vocabulary, training noise and extra loss terms."""
import ast
import inspect
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_target
from test_architecture import import_graph

from eaglekit.heads import (
    EAGLE1,
    EAGLE3,
    HEADS,
    KINDS,
    Eagle1Head,
    Eagle3Head,
    HeadConfig,
    base,
    build_head,
    head_class,
)
from eaglekit.heads.base import DraftHead
from eaglekit.heads.layers import shift_left
from eaglekit.heads.registry import tap_layers

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=8)


def test_heads_registry_has_one_class_per_kind():
    from eaglekit.heads.eagle3 import PEagleHead

    assert tuple(HEADS) == KINDS and KINDS[:3] == (EAGLE1, EAGLE3, "peagle")
    assert (HEADS[EAGLE1], HEADS[EAGLE3], HEADS["peagle"]) == (Eagle1Head, Eagle3Head, PEagleHead)
    assert head_class("eagle3") is Eagle3Head
    with pytest.raises(ValueError, match="unknown head kind 'eagle2'; choose one of eagle1, eagle3, peagle"):
        head_class("eagle2")


def test_heads_taps_and_what_they_read(target):
    assert tap_layers(EAGLE3, target) == target.default_taps == (2, 4, 5)
    assert tap_layers(EAGLE3, target, [1, 6]) == (1, 6)
    assert tap_layers(EAGLE1, target, [1, 6]) == ()  # EAGLE-1 reads only `last`
    e1 = build_head(HeadConfig.from_target(target, kind=EAGLE1), target)
    e3 = build_head(HeadConfig.from_target(target, kind=EAGLE3, aux_layer_ids=[1, 6]), target)
    assert (e1.reads, e1.taps, e1.has_draft_vocab) == ("last", (), False)
    assert (e3.reads, e3.taps, e3.has_draft_vocab) == ("taps", (1, 6), True)
    ids = torch.randint(0, 64, (1, 7))
    out = target.forward(ids, layer_ids=e3.taps)
    torch.testing.assert_close(e3.fuse_output(out), e3.fc(out.taps))
    torch.testing.assert_close(e1.fuse_output(target.forward(ids, layer_ids=e1.taps)), out.last)
    with pytest.raises(ValueError, match="has no 'taps' \\(run the target with layer_ids=head.taps\\)"):
        e3.fuse_output(target.forward(ids, layer_ids=e1.taps))


def test_heads_training_hooks(target):
    """EAGLE-1 adds feature noise and its SmoothL1 term; EAGLE-3's loss is the CE alone, noise ignored."""
    torch.manual_seed(0)
    e1 = build_head(HeadConfig.from_target(target, kind=EAGLE1), target)
    e3 = build_head(HeadConfig.from_target(target, kind=EAGLE3, draft_vocab_size=32), target)
    out = target.features(torch.randint(0, 64, (1, 6)))
    batch = {"last": out.last, "taps": out.taps}
    torch.testing.assert_close(e3.training_features(batch, noise=0.5), e3.fc(out.taps))
    assert torch.equal(e1.training_features(batch, 0.0), out.last)
    noisy = e1.training_features(batch, 0.1) - out.last
    assert 0 < noisy.abs().max() <= 0.1 + 1e-6
    loss = SimpleNamespace(token_weight=0.1, feature_weight=2.0, step_decay=0.5)
    ce, hidden, valid = torch.tensor(3.0), torch.randn(1, 6, 32), torch.tensor([[1, 1, 1, 0, 0, 0]])
    assert e3.step_loss(ce, hidden, batch, 1, valid, loss) is ce
    l1 = torch.nn.functional.smooth_l1_loss(hidden, shift_left(out.last, 2), reduction="none").mean(-1)
    want = 0.1 * 3.0 + 2.0 * 0.5 * (l1 * valid).sum()
    torch.testing.assert_close(e1.step_loss(ce, hidden, batch, 1, valid, loss), want)


def test_heads_base_imports_no_saving_or_hub():
    """DraftHead knows nothing of files or the Hub; heads.io / export.hub give it those two methods."""
    import eaglekit.export  # noqa: F401  (gives DraftHead.push_to_hub)

    imported = {n.module for n in ast.walk(ast.parse(inspect.getsource(base))) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"eaglekit.heads.io", "eaglekit.export.hub", "eaglekit.export.formats"}
    assert DraftHead.save_pretrained.__module__ == "eaglekit.heads.io"
    assert DraftHead.push_to_hub.__module__ == "eaglekit.export.hub"


LAYERS = {  # lowest first: a module imports only modules of lower layers of its package
    "eaglekit.heads": [{"config", "ttt_attention"}, {"layers"}, {"objectives"}, {"base"},
                       {"eagle1", "eagle3", "dflash", "mtp"}, {"dspark"}, {"registry"}, {"io"}],
    "eaglekit.export": [{"engines", "verifier", "mtp_checkpoint"}, {"dflash_layout"}, {"dspark_layout"}, {"dflash2_layout"}, {"layouts"},
                        {"formats"}, {"hub"}, {"cli"}, {"push_cli"}],
}


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_package_modules_import_only_lower_layers(package):
    """heads: config → layers → objectives → base → eagle1/eagle3/dflash → dspark → registry → io; export:
    engines → dflash_layout → dspark_layout → dflash2_layout → layouts → formats → hub → CLIs (function-local imports counted, tests/test_architecture.py's
    graph); nothing in heads imports export (the networks and their native files stand alone)."""
    graph = import_graph()
    names = {m.rsplit(".", 1)[1] for m in graph if m.startswith(package + ".")}
    assert names == set().union(*LAYERS[package]), "give every module a layer (and drop removed ones)"
    layer = {name: i for i, group in enumerate(LAYERS[package]) for name in group}
    upward = [(m, dep) for m in sorted(names) for dep in sorted(graph[f"{package}.{m}"])
              if dep.startswith(package + ".") and layer[dep.rsplit(".", 1)[1]] >= layer[m]]
    assert upward == []
    if package == "eaglekit.heads":
        assert not [m for m in graph if m.startswith("eaglekit.heads") and
                    any(d.startswith("eaglekit.export") for d in graph[m])]
