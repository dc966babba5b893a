"""Greedy exactness on the real SmolLM2 target with an untrained EAGLE 3.1 head (fc_norm and norm_output on):
decode.generate equals transformers' greedy decoding token for token (the shared references and the
near-tie rule of test_decode_real)."""
import pytest
import torch
from test_decode_real import assert_same_or_near_tie, hf_greedy, mt_bench_prompts

from eaglekit import decode
from eaglekit.decode.drafters import TreeSpec
from eaglekit.heads import HeadConfig, build_head

pytestmark = [pytest.mark.real, pytest.mark.usefixtures("one_thread")]


def test_decode_eagle31_real_greedy_smollm2(smollm2):
    t, n = smollm2, 24
    torch.manual_seed(0)
    head = build_head(HeadConfig.from_target(t, kind="eagle3", fc_norm=True, norm_output=True), t)
    tree = TreeSpec(depth=3, top_k=4, total_tokens=10)
    ties = 0
    for i, ids in enumerate(mt_bench_prompts(t, 2)):
        out = decode.generate(t, head, ids, n, tree=tree)
        ties += assert_same_or_near_tie(t, hf_greedy(t, ids, n), out.sequences, f"smollm2 eagle3.1 prompt {i}")
        assert max(out.stats.tree_sizes) == tree.total_tokens
    assert ties <= 1, f"{ties} near-tie divergences: more than chance would give"
