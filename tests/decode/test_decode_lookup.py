"""Prompt lookup grafted onto draft trees: the n-gram index (against a brute-force scan), the graft, greedy exactness with every tree
drafter, and the KV cache after each step. The sampling law with lookup is in test_decode_sampling.py."""
import operator

import pytest
import torch
from helpers import tiny_target
from test_decode_core import PROMPTS, TREE, hf_greedy, tiny_head, watch_cache

from eaglekit import decode
from eaglekit.decode.draft_model import ModelTreeDrafter
from eaglekit.decode.drafters import EagleDrafter, PlainDrafter, Tree, TreeSpec, ancestors, down_paths, prune
from eaglekit.decode.lookup import BY_MATCH, LookupDrafter, NgramIndex, branch_lengths, graft_chain

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest


def find_continuation(seq, max_tokens, max_ngram=3, min_ngram=1):
    index = NgramIndex(max_ngram, min_ngram)
    index.extend(seq)
    return index.continuation(max_tokens)[1]


def scan_continuation(seq, max_tokens, max_ngram, min_ngram):
    """The definition, by brute force: what followed the latest earlier occurrence of the longest matching
    tail n-gram, repeated with its period where it runs into the tail (``max_tokens`` per match length
    from ``min_ngram`` up when a list)."""
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == seq[-n:]:
                max_tokens = max_tokens if isinstance(max_tokens, int) else max_tokens[n - min_ngram]
                out = seq[start + n:start + n + max_tokens]
                while len(out) < max_tokens:
                    out += out[: max_tokens - len(out)]
                return out
    return []


def test_decode_lookup_find_continuation():
    seq = [5, 1, 2, 7, 8, 1, 2, 9, 4, 1, 2]
    assert find_continuation(seq, 3, max_ngram=2) == [9, 4, 1]  # latest earlier "1 2", not the first
    assert find_continuation(seq, 1, max_ngram=2) == [9]
    assert find_continuation(seq + [3], 4) == []  # 3 never occurred before
    assert find_continuation([4, 7, 5, 9, 7, 5], 2, max_ngram=3) == [9, 7]  # "7 5" (no "9 7 5" before)
    # the longest n-gram wins over a later shorter match: "1 2 9" after "8 1 2 9 ... 2 9" context
    assert find_continuation([8, 1, 2, 9, 6, 3, 2, 9, 0, 1, 2, 9], 2, max_ngram=3) == [6, 3]
    assert find_continuation([3, 3], 4) == [3, 3, 3, 3]  # runs into the tail: repeats with its period
    assert find_continuation([7, 1, 2, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert find_continuation([6], 4) == [] and find_continuation([1, 2, 1], 2, min_ngram=2) == []
    # one length per match length: the longest match picks its own
    assert find_continuation([4, 7, 5, 9, 7, 5], (1, 3, 6)) == [9, 7, 5]  # a 2-gram match: 3 tokens
    assert find_continuation([4, 7, 5, 9, 7, 5], (1, 0, 6)) == []  # 0 after a 2-gram: no branch, no fallback
    assert find_continuation([8, 1, 2, 9, 6, 3, 2, 9, 0, 1, 2, 9], (1, 1, 3)) == [6, 3, 2]  # 3-gram
    assert find_continuation([5, 6, 7, 5], (2, 9, 9)) == [6, 7]  # only "5" occurred before: a 1-gram
    assert find_continuation([1, 2, 3, 1, 2], (4, 1), max_ngram=3, min_ngram=2) == [3, 1, 2, 3]  # "1 2"


def test_decode_lookup_branch_lengths():
    assert branch_lengths(5) == (5, 5, 5) and branch_lengths("2,5,10") == BY_MATCH == branch_lengths([2, 5, 10])
    assert branch_lengths((0, 4), max_ngram=3, min_ngram=2) == (0, 4)
    for bad in (0, [2, 5], [0, 0, 0], [1, -1, 3], "2,5,x"):
        with pytest.raises(ValueError, match="prompt lookup"):
            branch_lengths(bad)


def test_decode_lookup_index_grown_in_steps_equals_the_scan():
    g = torch.Generator().manual_seed(0)
    for max_n, min_n in ((3, 1), (2, 2), (4, 2)):
        seq, index = [], NgramIndex(max_n, min_n)
        for _ in range(60):
            step = torch.randint(0, 6, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
            seq += step
            index.extend(step)
            assert index.continuation(4)[1] == scan_continuation(seq, 4, max_n, min_n), (seq, max_n, min_n)
            lengths = list(range(1, max_n - min_n + 2))  # a different length per match length
            assert index.continuation(lengths)[1] == scan_continuation(seq, lengths, max_n, min_n), (seq, lengths)


def _tree(tokens, parents):
    parents = torch.tensor(parents)
    depths = torch.zeros(len(parents), dtype=torch.long)
    for i, p in enumerate(parents.tolist()):
        depths[i] = 1 if p < 0 else depths[p] + 1
    return Tree(torch.tensor(tokens), parents, depths, torch.full((len(tokens),), 0.5))


def test_decode_lookup_graft_shares_nodes_and_keeps_children_distinct():
    base = _tree([10, 11, 12, 13], [-1, -1, 0, 0])  # root -> 10 -> {12, 13}; root -> 11
    t = graft_chain(base, [10, 13, 20, 21])  # shares 10 -> 13, hangs 20 -> 21 below 13
    assert t.tokens.tolist() == [10, 11, 12, 13, 20, 21]
    assert t.parents.tolist() == [-1, -1, 0, 0, 3, 4] and t.depths.tolist() == [1, 1, 2, 2, 3, 4]
    assert t.q_token[:4].tolist() == [0.5] * 4 and not t.sampled
    t = graft_chain(base, [12, 10])  # no shared first token: a new branch below the root
    assert t.parents.tolist()[4:] == [-1, 4] and t.depths.tolist()[4:] == [1, 2]
    assert graft_chain(base, [10, 12]) is base and graft_chain(base, []) is base  # already a path
    chain = graft_chain(Tree.empty(), [7, 8, 9])
    assert chain.is_chain and chain.tokens.tolist() == [7, 8, 9] and chain.depths.tolist() == [1, 2, 3]
    for tree in (graft_chain(base, [10, 13, 20, 21]), graft_chain(base, [12, 10])):
        kids = tree.children()
        assert all(len(set(tree.tokens[k].tolist())) == len(k) for k in kids)
        a = ancestors(tree.parents)
        assert all(int(a[i + 1].sum()) == int(d) + 1 for i, d in enumerate(tree.depths))  # a path per node


def test_decode_lookup_prune_keeps_the_likeliest_paths():
    # root -> 10 (0.6) -> {12 (0.5), 13 (0.4)}; root -> 11 (0.3) -> 14 (0.9): paths 0.6, 0.3, 0.3, 0.24, 0.27
    tree = _tree([10, 11, 12, 13, 14], [-1, -1, 0, 0, 1])
    tree = Tree(tree.tokens, tree.parents, tree.depths, torch.tensor([0.6, 0.3, 0.5, 0.4, 0.9]))
    two = prune(tree, 2)
    assert two.tokens.tolist() == [10, 11] and two.parents.tolist() == [-1, -1]
    four = prune(tree, 4)  # 0.27 beats 0.24: 14 stays with its parent 11, 13 goes
    assert four.tokens.tolist() == [10, 11, 12, 14] and four.parents.tolist() == [-1, -1, 0, 1]
    assert four.depths.tolist() == [1, 1, 2, 2] and four.q_token.tolist() == pytest.approx([0.6, 0.3, 0.5, 0.9])
    assert prune(tree, 5) is tree and len(prune(tree, 0)) == 0
    with pytest.raises(ValueError, match="sampled"):
        prune(Tree.chain(torch.tensor([1, 2]), torch.ones(2), sampled=True), 1)


def test_decode_down_paths_equal_the_per_node_tensor_fold():
    """Path products (calibrate) and log sums (prune) on host lists: the same doubles as folding 0-d tensors
    node by node, parents first."""
    assert down_paths([0.6, 0.3, 0.5, 0.4, 0.9], [-1, -1, 0, 0, 1], operator.mul) == pytest.approx(
        [0.6, 0.3, 0.3, 0.24, 0.27])
    g = torch.Generator().manual_seed(0)
    parents = [-1, -1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(2, 60)]
    q = torch.rand(60, generator=g, dtype=torch.float64)
    for combine, fold, values in ((operator.mul, torch.Tensor.mul_, q), (operator.add, torch.Tensor.add_, q.log())):
        ref = values.clone()
        for i, p in enumerate(parents):
            if p >= 0:
                fold(ref[i], ref[p])
        assert down_paths(values.tolist(), parents, combine) == ref.tolist()


class InnerSizes(LookupDrafter):
    """Records (had a lookup branch, nodes kept from the inner tree) per draft."""

    def draft(self, max_depth):
        branch = bool(self.context.continuation(self.lengths)[1][:max_depth])
        tree = super().draft(max_depth)
        self.sizes = getattr(self, "sizes", []) + [(branch, self.first_grafted)]
        return tree


def test_decode_lookup_greedy_equals_hf_every_tree_drafter():
    """Greedy decoding with a lookup branch on no drafter, an EAGLE-3 head and a draft-model tree gives the
    target's own tokens; lookup found continuations, and drafts beyond what the inner drafter could
    propose (none at all for PlainDrafter) were accepted."""
    t = tiny_target(vocab_size=64, layers=3)
    small = tiny_target(seed=1, vocab_size=64, layers=2)
    head = tiny_head(t, "eagle3", 48)
    for ids in PROMPTS + [[2, 5, 6, 7, 5, 6, 7, 5, 6]]:
        ref = hf_greedy(t, ids, 40)
        for name in ("plain", "eagle3", "model_tree"):
            inner = {"plain": PlainDrafter(), "eagle3": EagleDrafter(t, head, TreeSpec(**TREE)),
                     "model_tree": ModelTreeDrafter(t, small, TreeSpec(**TREE))}[name]
            dr = LookupDrafter(inner, 5)
            out = decode.generate(t, dr, torch.tensor([ids]), 40, eos_token_id=False)
            assert out.sequences.tolist() == ref.tolist(), (name, ids)
            assert dr.matches > 0 and dr.accepted > 0, (name, ids, dr.matches, dr.accepted)
            if name == "plain":  # the only drafts are lookup's: more than one token per forward means it hit
                assert max(out.stats.accept_lengths) > 1, ids
                # per match length, the accepted branch prefixes add up to the lookup nodes accepted
                counts = dr.accepted_by_match
                assert set(counts) <= {1, 2, 3} and sum(c for h in counts.values() for c in h.values()) == dr.matches
                assert sum(k * c for h in counts.values() for k, c in h.items()) == dr.accepted, counts
            # the generate() switch builds the same wrapper around what api.make_drafter builds
            plain_arg = {"plain": None, "eagle3": head, "model_tree": ModelTreeDrafter(t, small, TreeSpec(**TREE))}
            via_kw = decode.generate(t, plain_arg[name], torch.tensor([ids]), 40, eos_token_id=False, tree=TREE,
                                     prompt_lookup=5)
            assert via_kw.sequences.tolist() == ref.tolist(), (name, ids)
            assert via_kw.stats.accept_lengths == out.stats.accept_lengths, (name, ids)  # the same drafts
            by_match = decode.generate(t, plain_arg[name], torch.tensor([ids]), 40, eos_token_id=False, tree=TREE,
                                       prompt_lookup=BY_MATCH)  # branch lengths by match length
            assert by_match.sequences.tolist() == ref.tolist(), (name, ids)
            if name != "plain":  # the inner tree cut to its best node on steps with a branch
                inner = {"eagle3": EagleDrafter(t, head, TreeSpec(**TREE)),
                         "model_tree": ModelTreeDrafter(t, small, TreeSpec(**TREE))}[name]
                pruned = InnerSizes(inner, BY_MATCH, inner_nodes=1)
                cut = decode.generate(t, pruned, torch.tensor([ids]), 40, eos_token_id=False)
                assert cut.sequences.tolist() == ref.tolist(), (name, ids)
                with_branch = [n for branch, n in pruned.sizes if branch]
                assert with_branch and max(with_branch) <= 1, (name, ids, pruned.sizes)
                assert max(n for branch, n in pruned.sizes if not branch) > 1, (name, ids)  # left whole


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decode_lookup_kv_keep_equals_fresh_forward(temperature, monkeypatch):
    t = tiny_target(vocab_size=64, layers=3)
    checked = watch_cache(monkeypatch, t, 1e-5)
    dr = LookupDrafter(EagleDrafter(t, tiny_head(t, "eagle3", 48), TreeSpec(**TREE)), 4)
    out = decode.generate(t, dr, torch.tensor([[2, 5, 6, 7, 5, 6, 7, 5, 6]]), 24, temperature=temperature,
                          seed=0, eos_token_id=False)
    assert len(checked) == len(out.stats.accept_lengths) >= 4
    # greedy, the keep moved rows of grafted nodes too (this near-uniform tiny model's samples rarely repeat;
    # lookup acceptance under sampling is exercised by the sampling-law test)
    assert temperature > 0 or dr.accepted > 0


def test_decode_lookup_refuses_a_sampled_chain_and_bad_sizes():
    t = tiny_target(vocab_size=64, layers=2)
    small = tiny_target(seed=1, vocab_size=64, layers=2)
    with pytest.raises(ValueError, match="draft-model chain"):
        decode.generate(t, small, torch.tensor([PROMPTS[0]]), 4, prompt_lookup=3)
    with pytest.raises(ValueError, match="draft-model chain"):
        graft_chain(Tree.chain(torch.tensor([1, 2]), torch.ones(2), sampled=True), [3])
    with pytest.raises(ValueError, match="tokens >= 1.*got 0"):
        LookupDrafter(PlainDrafter(), 0)
    with pytest.raises(ValueError, match="min_ngram <= max_ngram, got 2, 1"):
        LookupDrafter(None, 4, max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="inner_nodes"):
        LookupDrafter(None, 4, inner_nodes=-1)
