"""Decoding with a DFlash head through the one loop (``decode.generate`` with ``decode.drafters.ParallelDrafter``):
greedy token-identical to transformers on a tiny target (chain, tree, the prompt-lookup graft, a batch of two
rows of different lengths) with an untrained head and with one trained here on the target's own greedy
text, whose drafts are accepted (so the exactness is tested where drafted tokens are kept); and on SmolLM2.

The drafter is built explicitly: ``decode.api.make_drafter`` recognises a head by its ``step`` method (and
``cost.measure`` times head steps), which a DFlash head does not have: it drafts a block with ``draft``. Once decode/ accepts a
parallel head without ``step``, "dflash" joins test_decode_parallel.KINDS and these can go through ``tree=``."""
from types import SimpleNamespace

import pytest
import torch
from helpers import hf_greedy, random_draft_vocab, tiny_target

from eaglekit import decode
from eaglekit.decode.drafters import ParallelDrafter, TreeSpec
from eaglekit.decode.lookup import LookupDrafter
from eaglekit.heads import HeadConfig, build_head
from eaglekit.heads.objectives import Teacher

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[2, 8, 9, 10], [2, 20, 21], [2, 30, 31, 32, 33, 34, 35]]
CHAIN, TREE = {"depth": 4, "top_k": 1, "total_tokens": 4}, {"depth": 3, "top_k": 3, "total_tokens": 9}


@pytest.fixture(scope="module")
def tiny():
    return tiny_target("llama", vocab_size=64, layers=3)


def dflash(target, block=5, draft_vocab=48, seed=0):
    torch.manual_seed(seed)
    head = build_head(HeadConfig.from_target(target, kind="dflash", num_layers=2, block_size=block,
                                             draft_vocab_size=draft_vocab, aux_layer_ids=[0, 1, 2]), target)
    if draft_vocab < target.vocab_size:
        random_draft_vocab(head, draft_vocab)
    return head


def run(target, head, prompts, n, tree, lookup=0):
    drafter = ParallelDrafter(target, head, TreeSpec(**tree))
    if lookup:
        drafter = LookupDrafter(drafter, lookup)
    return decode.generate(target, drafter, prompts if isinstance(prompts[0], list) and len(prompts) > 1
                           else torch.tensor(prompts), n, eos_token_id=False)


@pytest.fixture(scope="module")
def trained(tiny):
    """A DFlash head trained (block objective, 200 Adam steps) on the tiny target's own greedy continuations."""
    head = dflash(tiny, draft_vocab=64, seed=1)
    g = torch.Generator().manual_seed(0)
    seqs = [hf_greedy(tiny, [2, *torch.randint(7, 64, (3,), generator=g).tolist()], 36)[0] for _ in range(12)]
    ids = torch.stack(seqs)
    out = tiny.features(ids, layer_ids=head.taps)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "last": out.last, "taps": out.taps}
    teacher = Teacher.build(tiny.lm_head.weight, head.t2d)
    settings = SimpleNamespace(anchors=16, block_gamma=0.0, chunk_tokens=512, cache_teacher_mb=64, topk=0,
                               topk_weight=0.0, objective="kl")
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(200):
        loss, _ = head.training_loss(teacher, batch, settings, steps=4)
        opt.zero_grad()
        (loss / ids.numel()).backward()
        opt.step()
    return head.eval(), [s[:4].tolist() for s in seqs[:3]]  # and prompts whose continuation it learned


def test_decode_dflash_greedy_equals_hf_untrained_and_trained(tiny, trained):
    learned_head, learned = trained
    taus = {}
    for name, head, prompts in (("untrained", dflash(tiny), learned), ("trained", learned_head, learned),
                                ("trained, other prompts", learned_head, PROMPTS)):
        accepted = []
        for p in prompts:
            ref = hf_greedy(tiny, p, 20)
            for tree in (CHAIN, TREE):
                out = run(tiny, head, [p], 20, tree)
                assert torch.equal(out.sequences, ref), (name, p, tree)
                accepted += out.stats.accept_lengths
            out = run(tiny, head, [p], 20, TREE, lookup=3)
            assert torch.equal(out.sequences, ref), (name, p, "lookup")
        taus[name] = sum(accepted) / len(accepted)
    assert taus["trained"] > 2.0 and taus["trained"] > taus["untrained"] + 0.5, taus  # drafts were kept


def test_decode_dflash_batch_of_two_rows_of_different_lengths(tiny, trained):
    rows = [trained[1][0], PROMPTS[2]]
    for head in (dflash(tiny), trained[0]):
        for tree in (CHAIN, TREE):
            out = run(tiny, head, rows, 14, tree)
            T = out.sequences.shape[1] - 14
            for b, p in enumerate(rows):
                new = out.sequences[b, T:T + out.stats.rows[b].new_tokens]
                assert new.tolist() == hf_greedy(tiny, p, 14)[0, len(p):].tolist(), (b, tree)


@pytest.mark.real
def test_decode_dflash_greedy_equals_hf_on_smollm2(smollm2):
    """An untrained DFlash head on SmolLM2 (fp32): chain and tree on an MT-bench prompt, a batch of two."""
    from test_decode_real import assert_same_or_near_tie, mt_bench_prompts
    from test_decode_real import hf_greedy as real_greedy

    torch.manual_seed(0)
    head = build_head(HeadConfig.from_target(smollm2, kind="dflash", num_layers=2, block_size=5), smollm2)
    prompts, n, ties = mt_bench_prompts(smollm2, 2), 16, 0
    for i, ids in enumerate(prompts[:1]):
        for name, tree in (("chain", CHAIN), ("tree", TREE)):
            out = decode.generate(smollm2, ParallelDrafter(smollm2, head, TreeSpec(**tree)), ids, n)
            ties += assert_same_or_near_tie(smollm2, real_greedy(smollm2, ids, n), out.sequences,
                                            f"smollm2 dflash {name} prompt {i}")
    rows = [prompts[0][0], prompts[1][0]]
    out = decode.generate(smollm2, ParallelDrafter(smollm2, head, TreeSpec(**TREE)), rows, n)
    width = out.sequences.shape[1] - n
    for b, ids in enumerate(prompts):
        row = torch.cat([ids[0], out.sequences[b, width:width + out.stats.rows[b].new_tokens].cpu()])[None]
        ties += assert_same_or_near_tie(smollm2, real_greedy(smollm2, ids, n), row, f"smollm2 dflash batch row {b}")
    assert ties <= 1
