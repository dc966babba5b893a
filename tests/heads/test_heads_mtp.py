"""MTP heads: the next-n layer a DeepSeek-V3 / GLM-4.5 checkpoint ships (``model.layers.{L}.*``: enorm, hnorm,
eh_proj, the block, shared_head.norm; its experts stored one tensor each), read from a tiny random checkpoint
written in that layout. Loaded by eaglekit, the layer gives transformers' ``MtpModel`` logits (prefill and a
cached continuation); decoding with it is the target's own greedy decoding, chains and trees; a checkpoint
without the layer is one error naming it."""
import json

import pytest
import torch
import transformers
from arch_matrix import MATRIX, config
from helpers import hf_greedy
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpModel

from eaglekit import decode
from eaglekit.decode.drafters import TreeSpec
from eaglekit.heads import HeadCache, HeadConfig, build_head
from eaglekit.heads.mtp import load_shipped
from eaglekit.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")
EXTRAS = ("enorm", "hnorm", "shared_head.norm")


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def shipped(request, tmp_path_factory):
    """A tiny DeepSeek-V3 (GLM-4.5) checkpoint of 2 layers whose layer 2 is its MTP layer, as they ship it: a
    3-layer model's layer 2 (MoE, experts one tensor each) plus enorm / hnorm / eh_proj / shared_head (norm, head)
    and an embed_tokens copy under ``model.layers.2.``; config num_hidden_layers 2, num_nextn_predict_layers 1.
    Returns (folder, the 3-layer model, the extra tensors)."""
    path = tmp_path_factory.mktemp(f"{request.param}-mtp")
    arch = MATRIX[request.param]
    cfg = config(arch)
    cfg.num_hidden_layers = 3
    torch.manual_seed(0)
    full = getattr(transformers, arch.model_class)(cfg).eval()
    full.save_pretrained(path)
    from helpers import tiny_tokenizer

    tiny_tokenizer(cfg.vocab_size).save_pretrained(path)
    H = cfg.hidden_size
    g = torch.Generator().manual_seed(1)
    extras = {f"model.layers.2.{n}.weight": 1 + 0.1 * torch.randn(H, generator=g) for n in EXTRAS}
    extras["model.layers.2.eh_proj.weight"] = 0.05 * torch.randn(H, 2 * H, generator=g)
    extras["model.layers.2.shared_head.head.weight"] = full.lm_head.weight.detach().clone()
    extras["model.layers.2.embed_tokens.weight"] = full.model.embed_tokens.weight.detach().clone()
    tensors = {**load_file(path / "model.safetensors"), **extras}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((path / "config.json").read_text())
    conf.update(num_hidden_layers=2, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(conf))
    return path, full, extras


def reference(target, full, extras) -> MtpModel:
    """transformers' MtpModel on the target with the shipped layer's weights put in by hand."""
    ref = MtpModel(target.model, 1).eval()
    layer = ref.layers[0]
    layer.mtp_block.load_state_dict(full.model.layers[2].state_dict())
    with torch.no_grad():
        for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("post_norm", "shared_head.norm")):
            getattr(layer, ours).weight.copy_(extras[f"model.layers.2.{theirs}.weight"])
        layer.eh_proj.weight.copy_(extras["model.layers.2.eh_proj.weight"])
    return ref


def mtp_head(target):
    head = build_head(HeadConfig.from_target(target, kind="mtp"), target)
    return load_shipped(head, target)


def test_the_cli_decodes_with_the_targets_own_mtp_layers(shipped, capsys):
    """``eaglekit generate head=mtp``: the target checkpoint's MTP layer drafts; the text is plain decoding's."""
    from eaglekit.cli import main

    path, *_ = shipped
    args = ["generate", f"target={path}", "prompt=abc", "max_new_tokens=6", "tree=3,1,3"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "head=mtp"]) == 0
    out = capsys.readouterr()
    assert out.out == plain and "tau=" in out.err


def test_shipped_mtp_layer_gives_transformers_mtp_logits(shipped):
    path, full, extras = shipped
    target = load_target(str(path))
    head = mtp_head(target)
    assert head.config.num_layers == 1 and head.config.mtp_block.endswith("DecoderLayer")
    ref = reference(target, full, extras)
    ids = torch.randint(7, 512, (1, 16), generator=torch.Generator().manual_seed(2))
    last = target.forward(ids, layer_ids=()).last  # after the final norm: what the engines hand their MTP layer
    pos = torch.arange(15)[None]  # element t = (h_t, x_{t+1}) at position t
    with torch.no_grad():
        want = ref._project_to_logits(ref.forward_layer(0, last[:, :-1], pos, None, input_ids=ids[:, 1:]))
        cache = HeadCache()
        _, first = head.step(ids[:, 1:11], last[:, :10], pos[:, :10], cache=cache)
        _, rest = head.step(ids[:, 11:], last[:, 10:15], pos[:, 10:], cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), want, rtol=0, atol=1e-4)
    assert float((want - ref._project_to_logits(ref.forward_layer(0, last[:, :-1], pos, None,
                                                                  input_ids=ids[:, 1:] + 1))).abs().max()) > 1e-2


def fit(head, target, seqs: list[list[int]], steps: int) -> None:
    """A few AdamW steps of the MTP layer on the target's own greedy answers: element t = (h_t, x_{t+1}) learns
    x_{t+2} (the first depth; later depths reuse the layer, as the engines draft)."""
    opt = torch.optim.AdamW(head.layers.parameters(), lr=3e-3)
    data = [(torch.tensor([s]), target.forward(torch.tensor([s]), layer_ids=(), logits=False).last) for s in seqs]
    for _ in range(steps):
        for ids, last in data:
            _, logits = head.step(ids[:, 1:-1], last[:, :-2], torch.arange(ids.shape[1] - 2)[None])
            loss = torch.nn.functional.cross_entropy(logits[0].float(), ids[0, 2:])
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_decoding_with_the_mtp_layer_is_the_targets_own(shipped):
    """Chains (the engines' drafting: one layer, depth 3) and a tree from the MTP head, each giving transformers'
    greedy tokens: as shipped (a random layer, its drafts rejected) and fitted a little on the target's answer, so
    that drafts are partly accepted and the rejected tail is rolled back."""
    path, *_ = shipped
    target = load_target(str(path))
    head = mtp_head(target)
    prompt = torch.randint(7, 512, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_greedy(target, prompt, 24)[0, len(prompt):].tolist()
    ids = torch.tensor([prompt])
    for fitted in (False, True):
        if fitted:
            fit(head, target, [prompt + ref], steps=5)  # 5 steps: partly (40: always) accepted
        for tree in (TreeSpec(3, 1, 3), TreeSpec(3, 2, 6)):
            out = decode.generate(target, head, ids, 24, eos_token_id=False, tree=tree)
            assert out.sequences[0, len(prompt):].tolist() == ref, (fitted, tree)
            lengths = out.stats.accept_lengths
            assert (max(lengths) > 1 and len(set(lengths[:-1])) > 1) if fitted else max(lengths) == 1, (fitted, lengths)


def test_a_checkpoint_without_its_mtp_layer_is_one_error(shipped, tmp_path):
    path, _, _ = shipped
    bare = tmp_path / "bare"
    full_target = load_target(str(path))
    full_target.model.save_pretrained(bare)  # transformers drops the layer it did not load
    full_target.tokenizer.save_pretrained(bare)
    target = load_target(str(bare))
    head = build_head(HeadConfig.from_target(target, kind="mtp"), target)
    with pytest.raises(ValueError, match=f"{bare}: no MTP layers model.layers.2..2"):
        load_shipped(head, target)


def test_training_an_mtp_head_is_refused_by_its_config():
    from eaglekit.config import ConfigError
    from eaglekit.train.config import load_train_config

    with pytest.raises(ConfigError, match="head.kind=mtp: training an MTP head is not built yet"):
        load_train_config(None, ["target=x", "data.features_dir=y", "head.kind=mtp"])


def test_an_mtp_head_saves_and_reloads_bit_identically_and_its_exports_are_refused(shipped, tmp_path):
    from eaglekit.export import load_head
    from eaglekit.export.formats import ExportError, export_head

    path, *_ = shipped
    target = load_target(str(path))
    head = mtp_head(target)
    head.save_pretrained(tmp_path / "native")
    again = load_head(str(tmp_path / "native"), target)
    assert type(again) is type(head) and again.config == head.config
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values()))
    for layout in ("vllm", "sglang", "speculators"):
        with pytest.raises(ExportError, match=f"an MTP head has no {layout} layout yet"):
            export_head(head, tmp_path / layout, layout)
