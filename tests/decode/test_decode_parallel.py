"""Decoding with a parallel head (``decode.drafters.ParallelDrafter``: one head forward per step, a tree from the block's
per-depth top-k) on tiny random targets: greedy token-identical to transformers (chain, tree, a batch of
two rows of different lengths, the prompt-lookup graft), an oracle block whose acceptance is known in
advance (the drafter's bookkeeping), the exact law at temperature 1 (chain and tree, and the wrong rule
caught), and tree="auto" planning one forward per step. Parametrised over the parallel kinds (KINDS)."""
import pytest
import torch
from exact_law import ALPHA, acceptance_rule, chi2_pvalue, exact_joint, sample_counts
from helpers import hf_greedy, random_draft_vocab, tiny_target

from eaglekit import decode
from eaglekit.decode import api, cost
from eaglekit.decode.drafters import ParallelDrafter, TreeSpec, block_tree
from eaglekit.decode.lookup import LookupDrafter
from eaglekit.decode.loop import accept_minpq_on_topk
from eaglekit.heads import HeadCache, HeadConfig, build_head

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest

KINDS = ["peagle", "dflash", "dspark", "dflash2"]  # every parallel head kind (heads.base.ParallelHead subclasses)
PROMPTS = [[2, 8, 9, 10], [2, 20, 21], [2, 30, 31, 32, 33, 34, 35]]
CHAIN, TREE = {"depth": 4, "top_k": 1, "total_tokens": 4}, {"depth": 3, "top_k": 3, "total_tokens": 9}


def parallel_head(target, kind, block=4, draft_vocab=48, layers=2, seed=0):
    """An untrained parallel head of ``kind`` with a non-trivial draft vocabulary (DFlash 2: the full one, its
    only; a small selector with random codebooks, so its walk shapes the drafts)."""
    extra = {"selector_rank": 4, "selector_top_k": 4, "conv_group_size": 8} if kind == "dflash2" else {}
    draft_vocab = target.vocab_size if kind == "dflash2" else draft_vocab
    cfg = HeadConfig.from_target(target, kind=kind, num_layers=layers, block_size=block,
                                 draft_vocab_size=draft_vocab, aux_layer_ids=[0, 1, target.num_layers - 1], **extra)
    torch.manual_seed(seed)
    head = build_head(cfg, target)
    if draft_vocab < target.vocab_size:
        random_draft_vocab(head, draft_vocab)
    if kind == "dspark":  # a fresh DSpark's bias is zero: give it one, so its chain shapes the drafts
        with torch.no_grad():
            head.markov_w2.weight.normal_(0, 1.0)
    if kind == "dflash2":
        with torch.no_grad():
            head.candidate_selector.successor_codebook.normal_(0, 1.0)
            head.candidate_selector.predecessor_codebook.normal_(0, 1.0)
    return head


@pytest.fixture(scope="module")
def tiny():
    return tiny_target("llama", vocab_size=64, layers=3)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_parallel_greedy_equals_hf_chain_tree_lookup(tiny, kind):
    head = parallel_head(tiny, kind)
    for p in PROMPTS:
        ref = hf_greedy(tiny, p, 16)
        for tree in (CHAIN, TREE):
            out = decode.generate(tiny, head, torch.tensor([p]), 16, tree=tree, eos_token_id=False)
            assert torch.equal(out.sequences, ref), (kind, p, tree)
            s = out.stats  # the step bookkeeping: every emitted token counted once, within the tree's reach
            assert sum(s.accept_lengths) == s.new_tokens - 1 == 15  # (the prefill forward emits the first)
            assert s.path_lengths == s.accept_lengths  # no EOS or stop cut here
            assert all(1 <= a <= d + 1 for a, d in zip(s.accept_lengths, s.tree_depths)), (kind, s.accept_lengths)
            assert max(s.tree_sizes) <= tree["total_tokens"] and max(s.tree_depths) <= tree["depth"]
        out = decode.generate(tiny, head, torch.tensor([p]), 16, tree=TREE, prompt_lookup=3, eos_token_id=False)
        assert torch.equal(out.sequences, ref), (kind, p, "lookup")


@pytest.mark.parametrize("kind", KINDS)
def test_decode_parallel_batch_of_two_rows_of_different_lengths(tiny, kind):
    head = parallel_head(tiny, kind)
    rows = [PROMPTS[0], PROMPTS[2]]
    for tree in (CHAIN, TREE):
        out = decode.generate(tiny, head, rows, 14, tree=tree, eos_token_id=False)
        T = out.sequences.shape[1] - 14
        for b, p in enumerate(rows):
            assert out.sequences[b, T:].tolist() == hf_greedy(tiny, p, 14)[0, len(p):].tolist(), (kind, b, tree)


class TokenCache(HeadCache):
    """A cache that remembers its elements' tokens (the oracle below reads the context from it)."""

    def __init__(self):
        super().__init__()
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def crop(self, n):
        self.tokens = self.tokens[:n]
        return self


@torch.no_grad()
def _oracle_draft(self, cache, ids, g, position_ids):
    """An oracle block: the target's own greedy continuation of the cached context, depth by depth. Hard:
    the continuation's token alone (-30 elsewhere), ranked second from depth ``right`` on (an impostor
    first); else the target's logits along the continuation (its top-k become the tree's siblings)."""
    target, right, first, hard = self.oracle
    self._check_draft(cache, ids, g, position_ids)
    cache.tokens += ids[0].tolist()
    ctx, rows = [first] + cache.tokens, []
    for d in range(1, self.draft_depths + 1):
        key = tuple(ctx)
        if key not in self.memo:  # the law tests revisit the same contexts hundreds of times
            self.memo[key] = target.model(torch.tensor([ctx])).logits[0, -1].float()
        logits = self.memo[key]
        best = int(logits.argmax())
        lg = torch.full_like(logits, -30.0) if hard else logits.clone()
        if hard:
            lg[best] = 0.0
            if d >= right:
                lg[(best + 1) % len(lg)] = 1.0
        rows.append(lg[self.d2t.new_tensor(range(len(self.d2t))) + self.d2t])  # target ids -> draft order
        ctx = ctx + [best]
    return torch.stack(rows)[None]


def oracle(head, target, first, right=99, hard=True):
    """``head`` (any parallel kind) made an oracle (``_oracle_draft``) for prompts starting with ``first``."""
    head.oracle, head.memo = (target, right, first, hard), {}
    head.new_cache = TokenCache
    head.draft = _oracle_draft.__get__(head)
    return head


@pytest.mark.parametrize("kind", KINDS)
def test_decode_parallel_oracle_block_is_accepted_as_predicted(tiny, kind):
    for p in PROMPTS[:2]:
        head = oracle(parallel_head(tiny, kind, draft_vocab=64), tiny, p[0], right=3)
        ref = hf_greedy(tiny, p, 30)
        chain = decode.generate(tiny, head, torch.tensor([p]), 30, tree=CHAIN, eos_token_id=False)
        tree = decode.generate(tiny, head, torch.tensor([p]), 30, tree={"depth": 4, "top_k": 2, "total_tokens": 14},
                               eos_token_id=False)
        assert torch.equal(chain.sequences, ref) and torch.equal(tree.sequences, ref)
        # every full step: the chain takes depths 1..2 and the bonus, the tree every depth and the bonus
        assert chain.stats.accept_lengths[:-2] == [3] * (len(chain.stats.accept_lengths) - 2)
        full = head.draft_depths + 1
        assert tree.stats.accept_lengths[:-2] == [full] * (len(tree.stats.accept_lengths) - 2)


def test_decode_parallel_block_tree_shape():
    """The tree from per-depth top-k: depth-d children of the kept depth-(d-1) nodes are the top-k of depth
    d, the best total_tokens paths by product score kept, ancestors first; a top-1 tree is the argmax chain."""
    logq = torch.log_softmax(torch.tensor([[3.0, 2.0, 0.0, -1.0], [0.0, 4.0, 3.5, 0.0], [1.0, 0.0, 0.0, 5.0]]), -1)
    chain = block_tree(logq, TreeSpec(3, 1, 3), 3)
    assert chain.tokens.tolist() == [0, 1, 3] and chain.parents.tolist() == [-1, 0, 1]
    tree = block_tree(logq, TreeSpec(3, 2, 6), 3)
    assert tree.depths.tolist() == sorted(tree.depths.tolist()) and len(tree) == 6
    assert tree.tokens[tree.depths == 1].tolist() == [0, 1]
    for i, (p, d) in enumerate(zip(tree.parents.tolist(), tree.depths.tolist())):
        assert (p == -1) == (d == 1) and (p < i)
        if d == 2:
            assert int(tree.tokens[i]) in (1, 2)  # depth 2's top-2 under each depth-1 node
    torch.testing.assert_close(tree.q_token[0], logq[0, 0].exp())


V, PROMPT, NEW = 16, [2, 8, 9, 10], 3
LAW_CFG = {"temperature": 1.0}


def peaky(seed=0):
    t = tiny_target(seed=seed, vocab_size=V, layers=2, hidden=16)
    t.lm_head.weight.data.mul_(40.0)
    return t


@pytest.fixture(scope="module")
def law_setup():
    target = peaky()
    return target, exact_joint(target, LAW_CFG, PROMPT)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "dflash2"])  # DFlash 2 samples its walk instead:
@pytest.mark.parametrize("shape", ["chain", "tree"])  # its law is test_decode_dflash2.py's
def test_decode_parallel_sampling_law_at_temperature_1(law_setup, kind, shape):
    """The first 3 tokens' joint law over 800 seeded runs (chi-square, ALPHA = 1e-3, exact_law.py) with an
    oracle block (the target's greedy continuation: often right, so the walk goes deep); for the tree the
    wrong rule (min(1, p/q) on chosen tokens) must fail the same check."""
    target, exact = law_setup
    block = 2 if parallel_head(target, kind, block=2, draft_vocab=12, layers=1).draft_depths >= 2 else 3
    head = oracle(parallel_head(target, kind, block=block, draft_vocab=12, layers=1), target, PROMPT[0], hard=False)
    assert head.draft_depths == 2  # a block of 2 depths: the walk can descend twice
    tree = {"depth": 2, "top_k": 1, "total_tokens": 2} if shape == "chain" else {"depth": 2, "top_k": 4, "total_tokens": 8}
    counts, stats = sample_counts(target, head, LAW_CFG, 800, 1, PROMPT, NEW + 1, counted=NEW, tree=tree)
    assert chi2_pvalue([(counts, exact)]) > ALPHA, (kind, shape)
    lengths = [a for s in stats for a in s.accept_lengths]
    assert max(lengths) >= 3 and sum(lengths) / len(lengths) > 1.1, lengths  # the walk went deep
    if shape == "tree":
        with acceptance_rule(accept_minpq_on_topk):
            wrong, _ = sample_counts(target, head, LAW_CFG, 400, 1, PROMPT, NEW + 1, counted=NEW, tree=tree)
        assert chi2_pvalue([(wrong, exact)]) < ALPHA


@pytest.mark.parametrize("kind", KINDS)
def test_decode_parallel_auto_plans_one_forward_per_step(tiny, kind, tmp_path, monkeypatch):
    head = parallel_head(tiny, kind, block=3)
    costs = cost.measure(tiny, head, prefix_len=16, repeats=1)
    assert costs.draft_s is not None and costs.draft_s > 0
    assert costs.drafting(1, 1) == costs.drafting(3, 8) == costs.draft_s  # one forward whatever the tree
    # a confident synthetic pool and a drafting forward as dear as 2 verify rows: depth beyond the block is
    # never chosen, and the chosen depth does not shrink when only depth got dearer for an EAGLE head
    pools = {k: [([1] * k + [2] * k * k + [3] * k * k, [0.8 / k] * k + [0.6 / k / k] * 2 * k * k)] for k in (1, 2)}
    spec, _ = cost.choose(costs, pools, max_depth=head.draft_depths)
    assert spec.depth <= head.draft_depths
    ids = torch.randint(7, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(cost, "calibration_ids", lambda target: ids)
    made = cost.auto_plan(tiny, head, cache_dir=tmp_path)
    assert made.spec.depth <= head.draft_depths and made.costs["draft_s"] == pytest.approx(made.costs["draft_s"])
    drafter = api.make_drafter(tiny, head, tree=made) if made.drafting_pays else None
    assert drafter is None or isinstance(drafter, ParallelDrafter)
    assert isinstance(api.make_drafter(tiny, head, tree=TREE, prompt_lookup=3).inner, ParallelDrafter)
    out = decode.generate(tiny, head, torch.tensor([PROMPTS[0]]), 8, tree="auto", eos_token_id=False)
    assert torch.equal(out.sequences, hf_greedy(tiny, PROMPTS[0], 8))


def test_decode_parallel_choose_charges_one_forward_whatever_the_depth():
    """With draft_s set, a deeper tree costs no more drafting: a confident pool then gets the deepest
    tree allowed; the same pool with per-level costs (an autoregressive head) stops earlier."""
    verify = {1: 0.040, 2: 0.041, 4: 0.042, 8: 0.044, 16: 0.05, 32: 0.07, 64: 0.12, 96: 0.2}
    levels = {k: 0.02 for k in cost.LEVEL_SIZES}
    pools = {1: [([1, 2, 3, 4, 5, 6], [0.9, 0.81, 0.73, 0.66, 0.59, 0.53])]}
    per_level = cost.choose(cost.Costs("cpu", verify, levels), pools, max_depth=6)[0]
    one_forward = cost.choose(cost.Costs("cpu", verify, levels, draft_s=0.02), pools, max_depth=6)[0]
    assert one_forward.depth == 6 and per_level.depth < 6
    assert cost.choose(cost.Costs("cpu", verify, levels, draft_s=0.02), pools, max_depth=4)[0].depth == 4


def test_decode_parallel_drafter_refuses_a_non_parallel_head(tiny):
    from test_decode_core import tiny_head

    with pytest.raises(TypeError, match="needs a parallel head"):
        ParallelDrafter(tiny, tiny_head(tiny, "eagle3", 48), TreeSpec(**TREE))
    assert isinstance(LookupDrafter(ParallelDrafter(tiny, parallel_head(tiny, "peagle"), TreeSpec(**TREE)), 3).inner,
                      ParallelDrafter)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_parallel_cli_generate_and_bench_take_a_parallel_head(kind, tmp_path, capsys):
    """`eaglekit generate` and `eaglekit bench` load a saved parallel head and decode with it (greedy: every
    method token-identical to plain decoding)."""
    import json

    from helpers import save_tiny

    from eaglekit.cli import main
    from eaglekit.target import load_target

    target_dir = save_tiny(tmp_path / "target", layers=3, max_position_embeddings=4096)
    parallel_head(load_target(str(target_dir)), kind, block=3).save_pretrained(tmp_path / "head")
    assert main(["generate", f"target={target_dir}", f"head={tmp_path / 'head'}", "prompt=hello",
                 "max_new_tokens=6", "tree=3,2,4"]) == 0
    assert "tau=" in capsys.readouterr().err
    assert main(["bench", f"target={target_dir}", f"head={tmp_path / 'head'}", "prompts=2", "max_new_tokens=8",
                 "repeats=1", "temperatures=[0.0]", "tree=3,2,4", "lookup_tokens=3", "hf_baselines=false",
                 f"out={tmp_path / 'bench'}"]) == 0
    (path,) = (tmp_path / "bench").glob("*.json")
    res = json.loads(path.read_text())["results"]["0.0"]
    assert {"plain", "ours", "ours_lookup"} <= set(res)
    assert all(r["identical_to_plain"] == "2/2" for r in res.values()), res
