"""Greedy exactness on real targets (fp32): decode.generate must equal transformers' own greedy
``generate`` token for token, with an untrained EAGLE head (tree drafting), a head trained in the suite
(``fitted_head``: deep trees accepted whole) and with a model drafting for itself (chain; every draft is
right, so tau must be maximal; and a draft-model tree).

Near-tie rule (docs/design.md, "Acceptance"): a verify pass does its matmuls in another shape than
one-token decoding, so a genuine near-tie may flip. A divergence is accepted only if, at the first
divergent position, the target's top-2 logit gap (fresh full forward over the common prefix) is below
1e-4; anything else fails.

Sizes are set by the test budget: SmolLM2 5 prompts x 24 tokens (EAGLE-3 head on all, EAGLE-1 on 3;
prompt lookup alone and on a head's tree: 4 x 40),
Qwen 0.5B 3 prompts x 8 tokens (HF, head, self-draft chain and tree; each self-draft decoding ends
on a step cut short by max_new_tokens: 1 + 4 + 3). The decode logic itself
(rejections, trees, EOS, caches) is covered on tiny models in test_decode_greedy_exact; these check the real
architectures and their fp32 numerics. Run `pytest --durations=0` for the current cost."""
import os

import pytest
import torch
from helpers import fit_head, shared_greedy

from eaglekit import assets, decode
from eaglekit.decode.drafters import TreeSpec

pytestmark = [pytest.mark.real, pytest.mark.usefixtures("one_thread")]  # one thread: see conftest
N_PROMPTS, TIE_GAP = 5, 1e-4


def mt_bench_prompts(target, n=N_PROMPTS):
    out = []
    for q in assets.load_mt_bench()[:n]:
        msgs = [{"role": "user", "content": q["turns"][0]}]
        out.append(target.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                                        return_dict=True)["input_ids"])
    return out


# the longest reference any real test takes per target: each prompt's is computed once, shorter ones sliced
REF_TOKENS = {"smollm2-135m-instruct": 40, "qwen2.5-coder-0.5b-instruct": 8}


def hf_greedy(target, ids, n):
    """transformers' greedy ``generate`` of ``n`` new tokens (shared across tests: helpers.shared_greedy)."""
    def compute(ids, m):
        return target.model.generate(ids, max_new_tokens=m, do_sample=False, num_beams=1, repetition_penalty=1.0,
                                     temperature=None, top_p=None, top_k=None)

    return shared_greedy(target.model, ids, n, compute, at_least=REF_TOKENS.get(target.name, 0))


def assert_same_or_near_tie(target, ref: torch.Tensor, ours: torch.Tensor, where: str) -> int:
    """0 if identical, 1 if they part at a measured near-tie; raises AssertionError otherwise."""
    a, b = ref[0].tolist(), ours[0].tolist()
    if a == b:
        return 0
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert j < min(len(a), len(b)), f"{where}: same tokens but different lengths {len(a)} vs {len(b)}"
    with torch.no_grad():
        logits = target.model(torch.tensor([a[:j]])).logits[0, -1].double()
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < TIE_GAP and {a[j], b[j]} <= set(logits.topk(2).indices.tolist()), \
        f"{where}: diverges at token {j} ({a[j]} vs {b[j]}) where the top-2 logit gap is {gap:.3g} " \
        "(not a near-tie)"
    return 1


def random_head(target, kind="eagle3"):
    from eaglekit.heads import HeadConfig, build_head

    torch.manual_seed(0)
    return build_head(HeadConfig.from_target(target, kind=kind), target)


def test_decode_real_greedy_smollm2(smollm2):
    t, n = smollm2, 24
    heads = {"eagle3": random_head(t, "eagle3"), "eagle1": random_head(t, "eagle1")}
    tree = TreeSpec(depth=3, top_k=4, total_tokens=10)
    ties = 0
    for i, ids in enumerate(mt_bench_prompts(t)):
        ref = hf_greedy(t, ids, n)
        for kind, head in heads.items():
            if kind == "eagle1" and i >= 3:  # EAGLE-1 shares the tree code; 3 prompts suffice
                continue
            out = decode.generate(t, head, ids, n, tree=tree)
            ties += assert_same_or_near_tie(t, ref, out.sequences, f"smollm2 {kind} prompt {i}")
            assert max(out.stats.tree_sizes) == tree.total_tokens
        print(f"smollm2 prompt {i} ok", flush=True)
    assert ties <= 2, f"{ties} near-tie divergences: more than chance would give"


def test_decode_real_greedy_smollm2_prompt_lookup(smollm2):
    """Prompt lookup on a real target, alone and grafted onto an untrained EAGLE-3 head's tree: still
    token-identical, and lookup's copies of the context were accepted (SmolLM2 repeats its prompt)."""
    from eaglekit.decode.drafters import EagleDrafter, PlainDrafter
    from eaglekit.decode.lookup import LookupDrafter

    t, n = smollm2, 40
    head = random_head(t, "eagle3")
    ties, accepted = 0, {}
    for i, ids in enumerate(mt_bench_prompts(t, 4)):
        ref = hf_greedy(t, ids, n)
        for name, inner in (("lookup", PlainDrafter()), ("head+lookup", EagleDrafter(t, head, TreeSpec(2, 3, 4)))):
            dr = LookupDrafter(inner, 5)
            out = decode.generate(t, dr, ids, n)
            ties += assert_same_or_near_tie(t, ref, out.sequences, f"smollm2 {name} prompt {i}")
            accepted[name] = accepted.get(name, 0) + dr.accepted
    assert ties <= 1 and min(accepted.values()) > 0, (ties, accepted)


def test_decode_real_greedy_qwen05_head_and_self_draft(qwen05_packed):
    t, n, gamma = qwen05_packed, 8, 3
    head = random_head(t, "eagle3")
    tree = TreeSpec(depth=2, top_k=2, total_tokens=3)
    self_tree = decode.ModelTreeDrafter(t, t, TreeSpec(depth=3, top_k=2, total_tokens=6))
    ties = 0
    for i, ids in enumerate(mt_bench_prompts(t, 3)):
        ref = hf_greedy(t, ids, n)
        out = decode.generate(t, head, ids, n, tree=tree)
        ties += assert_same_or_near_tie(t, ref, out.sequences, f"qwen05 eagle3 prompt {i}")
        out = decode.generate(t, self_tree, ids, n)  # a draft-model tree: its best node is always accepted
        tie = assert_same_or_near_tie(t, ref, out.sequences, f"qwen05 self-draft tree prompt {i}")
        ties += tie
        assert tie or min(out.stats.accept_lengths[:-1]) >= 2, (i, out.stats.accept_lengths)
        out = decode.generate(t, t, ids, n, gamma=gamma)
        tie = assert_same_or_near_tie(t, ref, out.sequences, f"qwen05 self-draft prompt {i}")
        ties += tie
        if not tie:  # drafting for itself, every proposal is the target's own greedy choice
            lengths = out.stats.accept_lengths
            assert lengths[:-1] == [gamma + 1] * (len(lengths) - 1), (i, lengths)
            assert 1 <= lengths[-1] <= gamma + 1
        print(f"qwen05 prompt {i} ok", flush=True)
    assert ties <= 2, f"{ties} near-tie divergences: more than chance would give"


_FITTED: dict = {}  # target name -> the head fitted_head trained (once per session, for both trained tests)


def fitted_head(target, root):
    """A head trained in the suite (60 optimizer steps, ~20 s) on the target's own greedy answers to the
    first ``N_PROMPTS`` MT-bench questions (transformers' references, shared with the tests: free here), so
    it is accepted deep on those prompts (τ ≈ 3 on SmolLM2): the exactness checks then cover long accepted
    paths, full-depth trees and bonus tokens on a real target, which an untrained head never reaches. A
    memorised head, not a useful one (test_train_real checks that training learns).
    ``EAGLEKIT_TEST_HEAD=<head dir>`` checks a head of yours instead."""
    from eaglekit.export import load_head

    if os.environ.get("EAGLEKIT_TEST_HEAD"):
        return load_head(os.environ["EAGLEKIT_TEST_HEAD"], target)
    if target.name not in _FITTED:
        convs = []
        for i, (q, ids) in enumerate(zip(assets.load_mt_bench(), mt_bench_prompts(target))):
            ref = hf_greedy(target, ids, REF_TOKENS[target.name])
            answer = target.tokenizer.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
            convs.append({"id": str(i), "messages": [{"role": "user", "content": q["turns"][0]},
                                                     {"role": "assistant", "content": answer}]})
        _FITTED[target.name] = load_head(fit_head(target, convs, root / "fitted"), target)
    return _FITTED[target.name]


@pytest.mark.slow  # the head's training (~20 s) and 5 decodes
def test_decode_real_greedy_trained_head(smollm2, tmp_path_factory):
    """With a trained head (fitted_head): token-identical on the prompts it was fitted to, with trees accepted
    to their full depth (4 drafted tokens and the bonus) as well as rejected ones."""
    t, tree = smollm2, TreeSpec(depth=4, top_k=4, total_tokens=16)
    head = fitted_head(t, tmp_path_factory.mktemp("fitted"))
    ties, lengths = 0, set()
    for i, ids in enumerate(mt_bench_prompts(t)):
        out = decode.generate(t, head, ids, 24, tree=tree)
        ties += assert_same_or_near_tie(t, hf_greedy(t, ids, 24), out.sequences, f"trained head prompt {i}")
        lengths.update(out.stats.path_lengths)
    assert ties <= 2, ties
    if not os.environ.get("EAGLEKIT_TEST_HEAD"):  # the fitted head reaches the full depth, and is rejected too
        assert 5 in lengths and min(lengths) < 5, sorted(lengths)
