"""A DSpark head in speculators' dspark layout: a real consumer (speculators' own DSparkDraftModel) loads
every tensor as eaglekit holds it, reads the block, taps, mask token, rank and the non-drafting anchor slot
from the config, and its Markov and confidence heads compute eaglekit's bias and confidence; the folder
loads back into eaglekit; the layouts with no DSpark reader refuse before writing. (llama.cpp's draft-dspark
serving the same layout is tests/engines/test_llama_cpp.py's real test.)"""
import pytest
import torch
from helpers import save_tiny

from eaglekit.export import export_head, load_head
from eaglekit.export.dspark_layout import RENAMES
from eaglekit.export.engines import ExportError
from eaglekit.heads import HeadConfig, build_head
from eaglekit.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")
V, VD = 64, 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tdir = save_tiny(tmp_path_factory.mktemp("verifier") / "tiny", layers=6, hidden=32, vocab_size=V)
    return tdir, load_target(tdir)


def dspark(target, vd=VD):
    torch.manual_seed(0)
    head = build_head(HeadConfig.from_target(target, kind="dspark", num_layers=2, block_size=5, draft_vocab_size=vd,
                                             markov_rank=8, aux_layer_ids=[1, 3, 5]), target)
    if vd < V:
        keep = torch.randperm(V)[:vd].sort().values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[keep] = True
        head.set_draft_vocab(keep - torch.arange(vd), t2d)
    with torch.no_grad():
        head.markov_w2.weight.normal_()
        head.confidence.bias.fill_(0.3)
    return head


@pytest.mark.parametrize("vd", [VD, V])  # a draft vocabulary (lm_head rows + maps) and the full one (neither)
def test_dspark_export_loads_in_speculators_and_back(tiny, tmp_path, vd):
    from speculators.models.dspark import DSparkDraftModel

    tdir, target = tiny
    head = dspark(target, vd)
    out = export_head(head, tmp_path / "dspark", "speculators", verifier=str(tdir))
    model = DSparkDraftModel.from_pretrained(str(out))
    assert (model.config.sample_from_anchor, model.config.block_size, model.config.aux_hidden_state_layer_ids,
            model.config.mask_token_id, model.config.markov_rank) == (False, 5, [1, 3, 5], head.config.mask_token_id, 8)
    theirs, ours = model.state_dict(), {RENAMES.get(k, k): v for k, v in head.state_dict().items()}
    for k, v in ours.items():
        if k in ("d2t", "t2d") and vd == V:
            continue  # a full vocabulary writes no maps
        torch.testing.assert_close(theirs[k], v, msg=k)
    torch.testing.assert_close(theirs["lm_head.weight"], head.draft_lm_head())
    torch.testing.assert_close(theirs["embed_tokens.weight"], target.model.get_input_embeddings().weight)
    hidden, prev = torch.randn(3, 4, 32), torch.randint(0, V, (3, 4))
    with torch.no_grad():
        torch.testing.assert_close(model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden),
                                   head.markov_bias(prev))
        conf = model.confidence_head(torch.cat([hidden, model.markov_head.prev_embeddings(prev)], -1))
        torch.testing.assert_close(conf, head.confidence_logits(hidden, prev))
    back = load_head(out, target)
    assert back.config.to_dict() == head.config.to_dict()
    for (n, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(a, b, msg=n)


def test_dspark_layouts_without_a_reader_refuse(tiny, tmp_path):
    _, target = tiny
    head = dspark(target)
    for layout in ("vllm", "sglang", "eagle1"):
        with pytest.raises(ExportError, match="dspark layout"):
            export_head(head, tmp_path / layout, layout)
        assert not (tmp_path / layout).exists()
