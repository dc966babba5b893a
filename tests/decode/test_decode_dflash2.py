"""Sampling with a DFlash 2 head through the one loop: the drafter samples the selector's walk (each token from
q = the sampling's warp of S over the slot's top-K candidates, after the token sampled before it) and the loop
verifies that chain with Leviathan's rule and that q. The first 3 tokens' joint law over seeded runs against
the target's exact law (exact_law.py's chi-square, ALPHA = 1e-3), and a wrong rule (residual = p, not
norm(max(p - q, 0))) and a wrong q (the unary softmax instead of the selector's) caught by the same check. Greedy exactness for DFlash 2 is test_decode_parallel.py's
(KINDS), the files a sampled step enters test_decode_one_path.py's."""
import pytest
import torch
from exact_law import ALPHA, acceptance_rule, chi2_pvalue, exact_joint, sample_counts
from test_decode_accept_law import leviathan_residual_is_p
from test_decode_parallel import LAW_CFG, NEW, PROMPT, TokenCache, parallel_head, peaky

from eaglekit.decode import loop

pytestmark = pytest.mark.usefixtures("one_thread")
CHAIN = {"depth": 2, "top_k": 1, "total_tokens": 2}


@pytest.fixture(scope="module")
def setup():
    target = peaky()
    return target, exact_joint(target, LAW_CFG, PROMPT)


def oracle_walk(head, target, scale=3.0):
    """``head``'s own sampled walk over unary logits set to the target's along its greedy continuation (often
    right, so the walk goes deep), its selector's random codebooks on top (so q is not p): ``block_hidden``
    returns fixed random states and records the context, ``logits`` the target's rows."""
    torch.manual_seed(1)
    with torch.no_grad():
        head.candidate_selector.hidden_projection.weight.normal_(0, 1.0)
        head.candidate_selector.successor_codebook.mul_(scale)
    hidden, memo = torch.randn(1, head.draft_depths, head.config.hidden_size), {}

    def block_hidden(cache, ids, g, position_ids):
        head._check_draft(cache, ids, g, position_ids)
        cache.tokens += ids[0].tolist()
        ctx, rows = [PROMPT[0]] + cache.tokens, []
        for _ in range(head.draft_depths):
            key = tuple(ctx)
            if key not in memo:
                memo[key] = target.model(torch.tensor([ctx])).logits[0, -1].float()
            rows.append(memo[key])
            ctx = ctx + [int(memo[key].argmax())]
        head.rows = torch.stack(rows)[None]
        return hidden

    head.new_cache, head.block_hidden, head.logits = TokenCache, block_hidden, lambda h: head.rows
    return head


def test_decode_dflash2_sampled_walk_keeps_the_law_at_temperature_1(setup, monkeypatch):
    target, exact = setup
    head = oracle_walk(parallel_head(target, "dflash2", block=3, layers=1), target)
    sampled, rule_for = [], loop.rule_for
    monkeypatch.setattr(loop, "rule_for", lambda tree: sampled.append(tree.sampled or not len(tree))
                        or rule_for(tree))
    counts, stats = sample_counts(target, head, LAW_CFG, 800, 1, PROMPT, NEW + 1, counted=NEW, tree=CHAIN)
    assert sampled and all(sampled)  # every non-empty draft was a sampled chain: Leviathan's rule with the walk's q
    assert chi2_pvalue([(counts, exact)]) > ALPHA
    lengths = [a for s in stats for a in s.accept_lengths]
    assert max(lengths) >= 3 and sum(lengths) / len(lengths) > 1.1, lengths  # the walk went deep
    monkeypatch.setattr(loop, "rule_for", rule_for)
    with acceptance_rule(leviathan_residual_is_p):
        wrong, _ = sample_counts(target, head, LAW_CFG, 400, 1, PROMPT, NEW + 1, counted=NEW, tree=CHAIN)
    assert chi2_pvalue([(wrong, exact)]) < ALPHA
    sampled_walk = head.draft_sampled  # the right rule with the unary's q in place of the selector's: caught

    def unary_q(*args):
        toks, q = sampled_walk(*args)
        return toks, torch.softmax(head.rows.float(), -1).expand_as(q)

    monkeypatch.setattr(head, "draft_sampled", unary_q)
    wrong, _ = sample_counts(target, head, LAW_CFG, 400, 1, PROMPT, NEW + 1, counted=NEW, tree=CHAIN)
    assert chi2_pvalue([(wrong, exact)]) < ALPHA
