"""MTP heads: the next-n layer a DeepSeek-V3 / GLM-4.5 checkpoint ships (``model.layers.{L}.*``: enorm, hnorm,
eh_proj, the block, shared_head.norm; its experts stored one tensor each), read from a tiny random checkpoint
written in that layout (Qwen3.5 / Qwen3-Next's ``mtp.*`` and Nemotron-H's ``mtp.layers.*`` further down). Loaded by eaglekit, the layer gives transformers' ``MtpModel`` logits (prefill and a
cached continuation); decoding with it is the target's own greedy decoding, chains and trees; a checkpoint
without the layer is one error naming it."""
import dataclasses
import json
from unittest import mock

import pytest
import torch
import transformers
from arch_matrix import MATRIX, config
from helpers import fit_mtp, hf_greedy
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpModel

from eaglekit import decode
from eaglekit.decode.drafters import TreeSpec
from eaglekit.export import load_head
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
    from helpers import nextn_checkpoint, tiny_tokenizer

    path = tmp_path_factory.mktemp(f"{request.param}-mtp")
    arch = MATRIX[request.param]
    cfg = config(arch)
    cfg.num_hidden_layers, cfg.architectures = 3, [arch.model_class]
    full, extras = nextn_checkpoint(path, cfg, tiny_tokenizer(cfg.vocab_size))
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


def exports_as_shipped(head, target, shipped, out) -> None:
    """``write_checkpoint``'s copy of the target's folder holds the tensor names of the ``shipped`` checkpoint (the
    head in the target's own layout) and reads back into a head bit-identical to ``head``."""
    from eaglekit.export.mtp_checkpoint import write_checkpoint

    out = write_checkpoint(head, target, out)
    names = {k for f in out.glob("*.safetensors") for k in load_file(f)}
    assert names == {k for f in shipped.glob("*.safetensors") for k in load_file(f)}
    again = mtp_head(load_target(str(out)))
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values()))


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
            fit_mtp(head, target, [prompt + ref], steps=5)  # 5 steps: partly (40: always) accepted
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
    with pytest.raises(ValueError, match=f"{bare}: no MTP layers model.layers.2.eh_proj"):
        load_shipped(head, target)





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
        with pytest.raises(ExportError, match=f"an MTP head has no {layout} layout: .* --to checkpoint"):
            export_head(head, tmp_path / layout, layout)


def test_training_unrolls_what_the_mtp_layer_drafts(shipped):
    """The training unroll (ttt_unroll: step k reads token t+1+k at position t+k and step k-1's output) gives, at
    element t and depth k, the logits of drafting a chain from prefix t with the layer (its own cache, the normed
    output fed back): the objective trains what the engines draft."""
    from eaglekit.heads.objectives import ttt_unroll

    path, *_ = shipped
    target = load_target(str(path))
    head = mtp_head(target)
    ids = torch.randint(7, 512, (1, 12), generator=torch.Generator().manual_seed(4))
    last = target.forward(ids, layer_ids=(), logits=False).last
    with torch.no_grad():
        unrolled = [logits for _, _, logits in ttt_unroll(head, ids, head.fuse(last), 3)]
        t = 6  # the chain from prefix t: elements 0..t exact, then the layer's own drafts
        cache = HeadCache()
        hidden, logits = head.step(ids[:, 1:t + 2], last[:, :t + 1], torch.arange(t + 1)[None], cache=cache)
        for k in range(3):
            torch.testing.assert_close(logits[0, -1], unrolled[k][0, t], rtol=0, atol=1e-5)
            token = ids[:, t + 2 + k:t + 3 + k]  # feed the true next token (the unroll's teacher forcing)
            hidden, logits = head.step(token, hidden[:, -1:], torch.tensor([[t + 1 + k]]), cache=cache)


def test_an_mtp_head_fine_tunes_from_the_shipped_layer(shipped, tmp_path):
    """Training head.kind=mtp started from the shipped layer (head.init_from_target) on the target's features,
    offline (DeepSeek-V3: `eaglekit prepare`, the last hidden state only) or online (GLM-4.5: computed as it
    trains): two steps move it, held-out τ_sim is reported, and the saved head decodes as the target does."""
    from helpers import tiny_conversations

    from eaglekit.cli import main
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import train

    path, *_ = shipped
    tiny_conversations(tmp_path / "convs.jsonl", n=10)
    prep = tmp_path / "prep"
    if "deepseek" in path.name:
        assert main(["prepare", f"target={path}", f"data={tmp_path / 'convs.jsonl'}", f"output_dir={prep}",
                     "kind=mtp", "num_conversations=0", "max_length=64", "progress=false"]) == 0
    data = [f"data.features_dir={prep}"] if "deepseek" in path.name else [
        f"data.conversations={tmp_path / 'convs.jsonl'}", "data.max_length=64"]
    cfg = load_train_config(None, [
        f"target={path}", *data, "data.eval_samples=3", "data.batch_size=2",
        "head.kind=mtp", "head.init_from_target=true", "loss.ttt_steps=2", "optim.max_steps=2", "progress=false",
        "trackers=[]", "eval_interval=0", "save_interval=0", f"output_dir={tmp_path / 'out'}"])
    final = train(cfg)
    assert final["step"] == 2 and 1.0 <= final["eval_tau_sim"] <= 3.0, final
    target = load_target(str(path))
    shipped_layer, tuned = mtp_head(target), load_head(str(tmp_path / "out" / "final"), target)
    assert any(not torch.equal(a, b) for a, b in zip(shipped_layer.parameters(), tuned.parameters()))
    prompt = torch.randint(7, 512, (16,), generator=torch.Generator().manual_seed(5)).tolist()
    out = decode.generate(target, tuned, torch.tensor([prompt]), 10, eos_token_id=False, tree=TreeSpec(3, 1, 3))
    assert out.sequences[0, 16:].tolist() == hf_greedy(target, prompt, 10)[0, 16:].tolist()


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_an_mtp_layer_trains_from_scratch(name):
    """A fresh MTP layer of the target's own decoder-layer class (a Llama ships none; a DeepSeek-V3 loaded
    without its next-n layer): initialised as the target's model class initialises it (an MoE block's experts
    and router too, which their modules leave as torch.empty memory), trained by the TTT objective (two steps
    move it, nothing goes NaN) and decoding as the target does."""
    from arch_matrix import tiny_target_of

    from eaglekit.heads.objectives import Teacher
    from eaglekit.train.config import LossConfig

    t = tiny_target_of(name)
    torch.manual_seed(0)
    head = build_head(HeadConfig.from_target(t, kind="mtp"), t).train()
    assert head.config.mtp_block.endswith("DecoderLayer") and head.config.num_layers == 1
    std = t.config.initializer_range
    for p_name, p in head.named_parameters():
        assert torch.isfinite(p).all() and (p.dim() < 2 or 0.5 * std < float(p.std()) < 2 * std), p_name
    ids = torch.randint(7, 512, (2, 16), generator=torch.Generator().manual_seed(6))
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "last": t.features(ids, layer_ids=()).last}
    teacher = Teacher.build(t.lm_head.weight, head.t2d)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in head.parameters()]
    for _ in range(2):
        loss, stats = head.training_loss(teacher, batch, LossConfig(ttt_steps=2), steps=2)
        assert torch.isfinite(loss) and loss > 0
        opt.zero_grad()
        (loss / sum(stats.total)).backward()
        opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, head.parameters()))
    prompt = ids[0].tolist()
    out = decode.generate(t, head.eval(), torch.tensor([prompt]), 8, eos_token_id=False, tree=TreeSpec(3, 2, 6))
    assert out.sequences[0, 16:].tolist() == hf_greedy(t, prompt, 8)[0, 16:].tolist()


def test_an_mtp_head_exports_into_the_targets_own_checkpoint(shipped, tmp_path, capsys):
    """`eaglekit export --to checkpoint`: a copy of the target's folder whose next-n layer is the (fine-tuned) head,
    written as the target ships it — the same tensor names (experts one tensor each), the target's own tensors
    unchanged — and read back by transformers' MtpModel (``load_shipped``) bit-identically."""
    from eaglekit.cli import main

    path, *_ = shipped
    target = load_target(str(path))
    head = mtp_head(target)
    prompt = torch.randint(7, 512, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    fit_mtp(head, target, [prompt + hf_greedy(target, prompt, 8)[0, 20:].tolist()], steps=2)
    head.save_pretrained(tmp_path / "tuned")
    out = tmp_path / "stitched"
    assert main(["export", "--head", str(tmp_path / "tuned"), "--out", str(out), "--to", "checkpoint",
                 "--target", str(path)]) == 0
    assert "holding the MTP head" in capsys.readouterr().out

    def tensors(folder):
        found = {}
        for f in sorted(folder.glob("*.safetensors")):
            found.update(load_file(f))
        return found

    before, after = tensors(path), tensors(out)
    assert set(after) == set(before)  # the layout the target ships, key for key
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("model.layers.2.") for k in changed), sorted(changed)[:5]
    again = mtp_head(load_target(str(out)))
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values()))


# ---- Qwen3.5's layout: mtp.fc, mtp.pre_fc_norm_{embedding,hidden}, mtp.layers.0.*, mtp.norm -------------------
@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def qwen35(request, tmp_path_factory):
    """A tiny Qwen3.5 (Gated DeltaNet + attention; Qwen3-Next: and MoE) checkpoint with an MTP layer as Qwen ships
    it (``mtp.*``, config mtp_num_hidden_layers 1): the block a full-attention layer of the target's (written by
    save_pretrained as a 5-layer model's layer 4: MoE experts one tensor each), the norms (1 + w). Returns (folder,
    the MTP modules by their checkpoint names)."""
    from arch_matrix import FAMILIES
    from helpers import tiny_tokenizer

    path = tmp_path_factory.mktemp(f"{request.param}-mtp")
    arch = FAMILIES[request.param]
    cfg = config(arch)
    L = cfg.num_hidden_layers
    cfg.num_hidden_layers, cfg.layer_types = L + 1, [*cfg.layer_types, "full_attention"]
    torch.manual_seed(0)
    full = getattr(transformers, arch.model_class)(cfg).eval()
    full.save_pretrained(path)
    tiny_tokenizer(cfg.vocab_size).save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    parts = {"block": full.model.layers[L], "fc": torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        parts[name] = type(full.model.norm)(cfg.hidden_size, eps=cfg.rms_norm_eps)
        parts[name].weight.data = 0.1 * torch.randn(cfg.hidden_size, generator=g)
    block = f"model.layers.{L}."
    tensors = {("mtp.layers.0." + k[len(block):] if k.startswith(block) else k): v
               for k, v in load_file(path / "model.safetensors").items()}
    tensors.update({f"mtp.{k}.weight": parts[k].weight.detach() for k in ("fc", "pre_fc_norm_embedding",
                                                                          "pre_fc_norm_hidden", "norm")})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((path / "config.json").read_text())
    conf.update(num_hidden_layers=L, layer_types=conf["layer_types"][:L], mtp_num_hidden_layers=1)
    (path / "config.json").write_text(json.dumps(conf))
    return path, parts


def test_qwen35_mtp_layer_computes_what_vllm_reads_and_decodes_exactly(qwen35, tmp_path):
    """Qwen's layer read from ``mtp.*``: logits equal to vLLM's qwen3_5_mtp computation written out by hand
    (fc over [norm_e(E(x_{t+1})), norm_h(h_t)], the full-attention block at position t, norm, the target's lm_head);
    chains and a tree (a row per path on the hybrid's own cache) decode as the target does; exported back into a
    copy of the checkpoint, the same tensor names and a bit-identical reload."""
    path, parts = qwen35
    target = load_target(str(path))
    head = mtp_head(target)
    assert head.config.mtp_block.endswith(":" + type(parts["block"]).__name__)
    ids = torch.randint(7, 512, (1, 14), generator=torch.Generator().manual_seed(7))
    last = target.forward(ids, layer_ids=(), logits=False).last
    S = ids.shape[1] - 1
    with torch.no_grad():
        e = target.embed_tokens(ids[:, 1:])
        z = parts["fc"](torch.cat([parts["pre_fc_norm_embedding"](e), parts["pre_fc_norm_hidden"](last[:, :-1])], -1))
        pos = torch.arange(S)[None]
        mask = torch.full((S, S), torch.finfo(z.dtype).min).triu(1)[None, None]
        y = parts["block"](z, attention_mask=mask, position_ids=pos, position_embeddings=target.decoder.rotary_emb(z, pos))
        want = target.lm_head(parts["norm"](y))
        _, got = head.step(ids[:, 1:], last[:, :-1], pos, cache=HeadCache())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    prompt = ids[0].tolist()
    ref = hf_greedy(target, prompt, 10)[0, len(prompt):].tolist()
    for tree in (TreeSpec(3, 1, 3), TreeSpec(2, 2, 4)):
        out = decode.generate(target, head, torch.tensor([prompt]), 10, eos_token_id=False, tree=tree)
        assert out.sequences[0, len(prompt):].tolist() == ref, tree
    exports_as_shipped(head, target, path, tmp_path / "stitched")


# ---- Nemotron-H's layout: mtp.layers.{0: fusion + attention block, 1: MoE block + final_layernorm} -------------
@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    """A tiny Nemotron-H (Mamba-2 + attention + MLP, MoE for the MTP layer) checkpoint whose MTP layer is written
    as Nemotron 3 ships it and vLLM's nemotron_h_mtp reads it (config num_nextn_predict_layers 1,
    mtp_layers_block_type [attention, moe]): ``mtp.layers.0.{enorm, hnorm, eh_proj, norm, mixer.*}``,
    ``mtp.layers.1.{norm, mixer.* (experts one tensor each), final_layernorm}`` — a 6-layer model's blocks 4 and 5
    as save_pretrained writes them. Returns (folder, the MTP modules)."""
    from arch_matrix import FAMILIES
    from helpers import tiny_tokenizer

    path = tmp_path_factory.mktemp("nemotron-h-mtp")
    moe = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "moe_shared_expert_intermediate_size": 32, "n_group": 1, "topk_group": 1}
    arch = FAMILIES["nemotron_h"]
    cfg = config(dataclasses.replace(arch, kw={**arch.kw, **moe, "hybrid_override_pattern":
                                               arch.kw["hybrid_override_pattern"] + "*E"}))
    L = cfg.num_hidden_layers - 2
    torch.manual_seed(0)
    full = transformers.NemotronHForCausalLM(cfg).eval()
    full.save_pretrained(path)
    tiny_tokenizer(cfg.vocab_size).save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    H = cfg.hidden_size
    norm = type(full.model.norm_f)
    parts = {"blocks": [full.model.layers[L], full.model.layers[L + 1]],
             "eh_proj": torch.nn.Linear(2 * H, H, bias=False)}
    for name in ("enorm", "hnorm", "final_layernorm"):
        parts[name] = norm(H, eps=cfg.layer_norm_epsilon)
        parts[name].weight.data = 1 + 0.1 * torch.randn(H, generator=g)
    tensors = {}
    for k, v in load_file(path / "model.safetensors").items():
        for j in (0, 1):
            k = k.replace(f"backbone.layers.{L + j}.", f"mtp.layers.{j}.")
        tensors[k] = v
    tensors.update({f"mtp.layers.0.{n}.weight": parts[n].weight.detach() for n in ("enorm", "hnorm", "eh_proj")})
    tensors["mtp.layers.1.final_layernorm.weight"] = parts["final_layernorm"].weight.detach()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((path / "config.json").read_text())
    conf.update(num_hidden_layers=L, layers_block_type=conf["layers_block_type"][:L], num_nextn_predict_layers=1,
                mtp_layers_block_type=["attention", "moe"])
    (path / "config.json").write_text(json.dumps(conf))
    return path, parts


def test_nemotron_h_mtp_layer_computes_what_vllm_reads_and_decodes_exactly(nemotron, tmp_path):
    """Nemotron-H's MTP layer read from ``mtp.layers.*``: logits equal to vLLM's nemotron_h_mtp computation written
    out by hand (eh_proj over [enorm(E(x_{t+1})), hnorm(h_t)], the attention block, the MoE block, final_layernorm,
    the target's lm_head); a chain and a tree decode as the target does; exported back into a copy of the
    checkpoint, the same tensor names and a bit-identical reload."""
    path, parts = nemotron
    target = load_target(str(path))
    head = mtp_head(target)
    ids = torch.randint(7, 512, (1, 14), generator=torch.Generator().manual_seed(8))
    last = target.forward(ids, layer_ids=(), logits=False).last
    S = ids.shape[1] - 1
    with torch.no_grad():
        e = target.embed_tokens(ids[:, 1:])
        y = parts["eh_proj"](torch.cat([parts["enorm"](e), parts["hnorm"](last[:, :-1])], -1))
        mask = torch.full((S, S), torch.finfo(y.dtype).min).triu(1)[None, None]
        for block in parts["blocks"]:
            y = block(y, attention_mask=mask, position_ids=torch.arange(S)[None])
        want = target.lm_head(parts["final_layernorm"](y))
        _, got = head.step(ids[:, 1:], last[:, :-1], torch.arange(S)[None], cache=HeadCache())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    prompt = ids[0].tolist()
    ref = hf_greedy(target, prompt, 10)[0, len(prompt):].tolist()
    from eaglekit.heads.objectives import Teacher
    from eaglekit.train.config import LossConfig

    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "last": last}  # the TTT objective runs the stack
    loss, _ = head.training_loss(Teacher.build(target.lm_head.weight, head.t2d), batch, LossConfig(ttt_steps=2), steps=2)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in head.layers[0].mtp_block.blocks[1].parameters()
                                        if p.requires_grad and p.dim() > 1)
    fit_mtp(head, target, [prompt + ref], steps=5)  # drafts partly accepted: the rejected tail rolled back
    for tree in (TreeSpec(3, 1, 3), TreeSpec(2, 2, 4)):
        out = decode.generate(target, head, torch.tensor([prompt]), 10, eos_token_id=False, tree=tree)
        assert out.sequences[0, len(prompt):].tolist() == ref, tree
        assert max(out.stats.accept_lengths) > 1, tree
    exports_as_shipped(head, target, path, tmp_path / "stitched")


# ---- several MTP layers walked one per depth (DeepSeek's sequential modules, vLLM's multi-module proposer) ------
def test_two_mtp_layers_draft_and_train_one_layer_per_depth(tmp_path):
    """A DeepSeek-V3 checkpoint shipping 2 MTP layers (``nextn_checkpoint(layers=2)``): the head walks them
    (layer k drafts depth k over a cache of its own; its element t reads layer k-1's output at t and token t+k+1).
    At every round of decoding the drafted chain is the one transformers' ``MtpModel`` gives running each layer over
    the whole sequence (``forward_layer``, layer k-1's outputs fed to layer k, drafts appended): as shipped (drafts
    rejected) and fitted a little (partly accepted), the output being the target's greedy. Training's unroll gives
    the same layers' logits at every element; a third TTT step is one error; the export reloads bit-identically."""
    from arch_matrix import MATRIX, config
    from helpers import nextn_checkpoint, tiny_tokenizer

    from eaglekit.decode import mtp_walk
    from eaglekit.heads.objectives import ttt_unroll

    arch = MATRIX["deepseek_v3"]
    cfg = config(arch)
    cfg.num_hidden_layers, cfg.architectures = 4, [arch.model_class]
    nextn_checkpoint(tmp_path / "ds", cfg, tiny_tokenizer(cfg.vocab_size), layers=2)
    target = load_target(str(tmp_path / "ds"))
    head = mtp_head(target)
    assert head.walks and head.config.num_layers == 2
    ref = MtpModel(target.model, 2).eval()

    def chain(seq, depth):  # each layer over the whole sequence, the chain's own drafts appended
        T, s, q = len(seq) - 1, list(seq), []
        h = target.forward(torch.tensor([seq[:T]]), layer_ids=(), logits=False).last
        for m in range(depth):
            h = ref.forward_layer(m, h, torch.arange(T)[None], None, input_ids=torch.tensor([s[m + 1:T + m + 1]]))
            p = torch.softmax(ref._project_to_logits(h)[0, -1], -1)
            s.append(int(p.argmax()))
            q.append(float(p.max()))
        return s[T + 1:], q

    rounds, draft = [], mtp_walk.MtpWalkDrafter.draft

    def spy(self, max_depth):
        tree = draft(self, max_depth)
        rounds.append((self.tokens.tolist(), tree.tokens.tolist(), tree.q_token.tolist()))
        return tree

    prompt = torch.randint(7, 512, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    want = hf_greedy(target, prompt, 20)[0, 12:].tolist()
    with mock.patch.object(mtp_walk.MtpWalkDrafter, "draft", spy), torch.no_grad():
        for fitted in (False, True):
            if fitted:
                with torch.enable_grad():
                    fit_mtp(head, target, [prompt + want], steps=6)
            ref.layers.load_state_dict(head.layers.state_dict())
            rounds.clear()
            out = decode.generate(target, head, torch.tensor([prompt]), 20, eos_token_id=False, tree=TreeSpec(2, 1, 2))
            assert out.sequences[0, 12:].tolist() == want
            assert max(out.stats.accept_lengths) == (2 if fitted else 1), out.stats.accept_lengths
            for seq, tokens, q in rounds:  # the drafts and their probabilities
                want_tokens, want_q = chain(seq, len(tokens))
                assert tokens == want_tokens, (seq, tokens, want_tokens)
                torch.testing.assert_close(torch.tensor(q), torch.tensor(want_q), rtol=1e-4, atol=0)
    ids = torch.randint(7, 512, (1, 12), generator=torch.Generator().manual_seed(4))
    last = target.forward(ids, layer_ids=(), logits=False).last
    with torch.no_grad():
        unrolled = [logits for _, _, logits in ttt_unroll(head, ids, head.fuse(last), 2)]
        h = last[:, :11]
        for m in range(2):
            n = 11 - m  # elements 0..n-1 take x_{t+m+1}
            h = ref.forward_layer(m, h[:, :n], torch.arange(n)[None], None, input_ids=ids[:, m + 1:m + 1 + n])
            torch.testing.assert_close(unrolled[m][0, :n], ref._project_to_logits(h)[0], rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="2 MTP layers walk 2 depths: train at most loss.ttt_steps=2"):
            list(ttt_unroll(head, ids, head.fuse(last), 3))
    exports_as_shipped(head, target, tmp_path / "ds", tmp_path / "stitched")
