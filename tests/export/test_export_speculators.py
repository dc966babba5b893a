"""A real consumer: vllm-project/speculators loads our speculators export with its own Eagle3DraftModel.

speculators is installed by scripts/setup.sh (the ``speculators`` extra, without its dependencies: they
would pull torchvision and an older transformers). It needs Python >= 3.11; only there is the test
skipped. The verifier is the tiny target's local folder, so nothing is fetched from the Hub.
"""
import sys

import pytest
import torch
from helpers import save_tiny

from eaglekit.export import export_head
from eaglekit.heads import HeadCache, HeadConfig, build_head, ttt_mask
from eaglekit.target import load_target

H, V, VD, N, S, STEPS = 32, 64, 16, 12, 9, 3
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def speculators_eagle3():
    if sys.version_info < (3, 11):
        reason = f"speculators needs Python >= 3.11 (this is {sys.version.split()[0]}): cannot be installed"
        print(reason)
        pytest.skip(reason)
    try:
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    except ImportError as e:  # installed by scripts/setup.sh: a missing one is a broken setup, not a skip
        pytest.fail(f"speculators is not importable ({e}); run scripts/setup.sh (speculators extra)")
    return Eagle3DraftModel, Eagle3SpeculatorConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tdir = save_tiny(tmp_path_factory.mktemp("verifier") / "tiny", layers=N, hidden=H, vocab_size=V)
    return tdir, load_target(tdir)


def make(target, layers, taps, nbr):
    torch.manual_seed(layers + len(taps or ()))
    cfg = HeadConfig.from_target(target, kind="eagle3", num_layers=layers, draft_vocab_size=VD,
                                 aux_layer_ids=taps, norm_before_residual=nbr)
    head = build_head(cfg, target)
    with torch.no_grad():
        for n, p in head.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    keep = torch.arange(VD) * 4 + 2
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    head.set_draft_vocab(keep - torch.arange(VD), t2d)
    return head


def speculators_logits(model, aux, ids):
    """Logits of each TTT step of speculators' own forward (captured at its lm_head)."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    try:
        with torch.no_grad():
            model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids),
                  position_ids=torch.arange(ids.shape[1])[None], ttt_steps=STEPS)
    finally:
        hook.remove()
    return seen


def eaglekit_logits(head, aux, ids):
    """The same training-time-test unroll with eaglekit's head: step k reads the tokens k ahead (teacher
    forcing), its own previous hidden state, positions + k, and the TTT mask over the cached steps."""
    out, cache, g = [], HeadCache(), head.fuse(aux)
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        for k in range(STEPS):
            tokens = torch.cat([ids[:, k:], ids.new_zeros(1, k)], dim=1)
            g, logits = head.step(tokens, g, pos + k, cache=cache, attn_mask=ttt_mask(ids.shape[1], k))
            out.append(logits)
    return out


@pytest.mark.parametrize("layers,taps,nbr", [(1, None, False), (2, [9, 1, 4, 7], True)])
def test_export_speculators_loads_our_export(speculators_eagle3, tiny, tmp_path, layers, taps, nbr):
    Eagle3DraftModel, Eagle3SpeculatorConfig = speculators_eagle3
    tdir, target = tiny
    head = make(target, layers, taps, nbr)
    out = export_head(head, tmp_path / "spec", "speculators", verifier=str(tdir))
    config = Eagle3SpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention's block masks need CUDA
    model = Eagle3DraftModel.from_pretrained(str(out), config=config).eval()
    assert model.config.speculators_config.verifier.name_or_path == str(tdir.resolve())
    assert model.config.eagle_aux_hidden_state_layer_ids == sorted(head.config.aux_layer_ids)
    assert model.config.norm_before_residual is nbr and len(model.layers) == layers
    assert torch.equal(model.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(model.d2t, head.d2t) and torch.equal(model.t2d, head.t2d)
    ids = torch.randint(0, V, (1, S))
    hidden = target.model(ids, output_hidden_states=True).hidden_states  # [k] = input of layer k
    aux = torch.cat([hidden[k] for k in model.config.eagle_aux_hidden_state_layer_ids], dim=-1)
    theirs = speculators_logits(model, aux, ids)
    ours = eaglekit_logits(head, target.forward(ids, layer_ids=head.taps).taps, ids)
    assert len(theirs) == len(ours) == STEPS
    diffs = [float((a - b).abs().max()) for a, b in zip(theirs, ours)]
    print(f"speculators vs eaglekit, max |logit diff| per TTT step: {diffs}")
    assert max(diffs) <= 1e-4
