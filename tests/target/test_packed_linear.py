"""oneDNN pre-packed linears (eaglekit/target/packed_linear.py): same outputs as aten's linear, autograd falls
back to the live weight, unpack restores, and greedy decoding on a packed real target still equals the
target's own (unpacked) greedy decoding."""
import pytest
import torch
from helpers import tiny_target

from eaglekit import decode
from eaglekit.decode.drafters import TreeSpec
from eaglekit.target.packed_linear import (
    available,
    dtype_supported,
    pack_linears,
    packed_count,
    unpack_linears,
)

pytestmark = [pytest.mark.skipif(not available(), reason="this torch build has no oneDNN packed linear"),
              pytest.mark.usefixtures("one_thread")]


def n_linears(module):
    return sum(isinstance(m, torch.nn.Linear) for m in module.modules())


def test_packed_logits_equal_aten_and_unpack_restores():
    t = tiny_target(vocab_size=64, layers=3)
    ids = torch.randint(3, 64, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = t.model(ids).logits
        assert pack_linears(t.model) == n_linears(t.model) > 0
        assert pack_linears(t.model) == n_linears(t.model)  # packing twice is a no-op
        got = t.model(ids).logits
        # fp32 with another summation order: a few ulps of the logits' scale, far below any real difference
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        unpack_linears(t.model)
        assert packed_count(t.model) == 0
        assert torch.equal(t.model(ids).logits, ref)  # aten again, bit for bit


def test_autograd_runs_on_the_live_weight():
    lin = torch.nn.Linear(16, 8)
    pack_linears(lin)
    with torch.no_grad():
        lin.weight.add_(1.0)  # an edit after packing: the packed copy is stale, autograd must not use it
    x = torch.randn(3, 16, requires_grad=True)
    y = lin(x)
    assert torch.equal(y, torch.nn.functional.linear(x, lin.weight, lin.bias))
    y.sum().backward()
    assert lin.weight.grad is not None and torch.equal(lin.weight.grad, x.detach().sum(0).expand(8, 16))


def test_bf16_packed_close_to_aten_or_left_unpacked_where_the_cpu_cannot():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = lin(x).float()
        n = pack_linears(lin)
        got = lin(x).float()
    if dtype_supported(torch.bfloat16):  # avx512 / avx_ne_convert CPUs
        assert n == packed_count(lin) == 1
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)  # bf16: 8 mantissa bits, other rounding order
    else:  # older x86: oneDNN refuses bf16; the linear must stay aten's, not fail
        assert n == packed_count(lin) == 0
        assert torch.equal(got, ref)
    fp32 = torch.nn.Linear(64, 32)
    assert pack_linears(fp32) == 1  # fp32 packs on every CPU with oneDNN, whatever bf16 does


def test_greedy_decode_on_a_packed_tiny_target_equals_hf():
    from decode.test_decode_core import hf_greedy, tiny_head

    t = tiny_target(vocab_size=64, layers=3)
    head = tiny_head(t)
    prompt = [2, 8, 9, 10]
    ref = hf_greedy(t, prompt, 20)
    pack_linears(t.model)
    pack_linears(head)
    out = decode.generate(t, head, torch.tensor([prompt]), 20, eos_token_id=False,
                          tree=TreeSpec(depth=3, top_k=3, total_tokens=8))
    assert out.sequences.tolist() == ref.tolist()


@pytest.mark.real
def test_packed_smollm2_greedy_matches_unpacked_hf(smollm2):
    """The session's SmolLM2 (packed, as every real test decodes it: tests/conftest.py) decoding 3 MT-bench
    prompts, plain and with a random packed EAGLE-3 head, must match transformers' greedy decoding on a second,
    unpacked SmolLM2 (near-tie rule of test_decode_real)."""
    from decode.test_decode_real import assert_same_or_near_tie, mt_bench_prompts, random_head

    from eaglekit.target import load_target

    unpacked = load_target("smollm2-135m-instruct")
    assert packed_count(unpacked.model) == 0 and packed_count(smollm2.model) == n_linears(smollm2.model)
    head = random_head(smollm2)
    pack_linears(head)
    ties = 0
    for i, ids in enumerate(mt_bench_prompts(unpacked, 3)):
        ref = unpacked.model.generate(ids, max_new_tokens=24, do_sample=False, num_beams=1, repetition_penalty=1.0,
                                      temperature=None, top_p=None, top_k=None)  # 24 tokens, not the 40 others share
        for name, drafter in (("plain", None), ("eagle3", head)):
            out = decode.generate(smollm2, drafter, ids, 24, tree=TreeSpec(depth=3, top_k=4, total_tokens=10))
            ties += assert_same_or_near_tie(unpacked, ref, out.sequences, f"packed {name} prompt {i}")
    assert ties <= 1, f"{ties} near-tie divergences in 6 decodes"
