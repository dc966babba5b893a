"""Decode loop on tiny random models: greedy exactness for every drafter, tree verification, KV keep,
bad input. The real-model exactness tests are in test_decode_real.py, sampling in test_decode_sampling.py."""
import pytest
import torch
from helpers import hf_greedy, random_draft_vocab, tiny_target

from eaglekit import decode
from eaglekit.decode import loop
from eaglekit.decode.draft_model import ModelTreeDrafter
from eaglekit.decode.drafters import Tree, TreeSpec
from eaglekit.target import cache_entries, cache_length, keep_accepted, new_cache

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest

PROMPTS = [[2, 8, 9, 10], [2, 20, 21], [2, 30, 31, 32, 33, 34, 35], [2, 11]]
TREE = {"depth": 3, "top_k": 3, "total_tokens": 8}


def tiny_head(target, kind="eagle3", draft_vocab=None, seed=0):
    from eaglekit.heads import HeadConfig, build_head

    aux = [0, 1, target.num_layers - 1] if kind == "eagle3" else None
    cfg = HeadConfig.from_target(target, kind=kind, draft_vocab_size=draft_vocab, aux_layer_ids=aux)
    torch.manual_seed(seed)
    head = build_head(cfg, target)
    if kind == "eagle3" and draft_vocab and draft_vocab < target.vocab_size:
        random_draft_vocab(head, draft_vocab)
    return head


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa")])
def test_decode_greedy_equals_hf_every_drafter(arch, attn):
    t = tiny_target(arch, attn=attn, vocab_size=64, layers=3)
    small = tiny_target(arch, seed=1, vocab_size=64, layers=2, attn=attn)
    drafters = {"plain": None, "chain": small, "self": t, "eagle3": tiny_head(t, "eagle3", 48),
                "eagle1": tiny_head(t, "eagle1"), "model_tree": ModelTreeDrafter(t, small, TreeSpec(**TREE)),
                "self_tree": ModelTreeDrafter(t, t, TreeSpec(**TREE)),
                "self_chain_tree": ModelTreeDrafter(t, t, TreeSpec(depth=3, top_k=1, total_tokens=3))}
    for ids in PROMPTS:
        ref = hf_greedy(t, ids, 20)
        for name, dr in drafters.items():
            out = decode.generate(t, dr, torch.tensor([ids]), 20, eos_token_id=False, tree=TREE, gamma=3)
            assert out.sequences.tolist() == ref.tolist(), (name, ids)
            assert out.stats.new_tokens == 20 and sum(out.stats.accept_lengths) == 19  # + 1 from the prefill
            if name == "self":  # a target drafting for itself is always right: gamma+1 per forward
                assert out.stats.accept_lengths[:-1] == [4] * (len(out.stats.accept_lengths) - 1)
            if name == "self_chain_tree":  # top_k 1 from itself = its greedy path: depth+1 per forward
                assert out.stats.accept_lengths[:-1] == [4] * (len(out.stats.accept_lengths) - 1)
            if name == "self_tree":  # the best-scored node is its own greedy next token: always accepted
                assert min(out.stats.accept_lengths[:-1]) >= 2
            if name in ("eagle3", "eagle1", "model_tree", "self_tree"):
                assert max(out.stats.tree_sizes) == TREE["total_tokens"]


def test_decode_tree_verify_logits_equal_path_forwards():
    """Each tree node's verify logits equal a plain forward over prefix + its root-to-node path."""
    t = tiny_target(vocab_size=64, layers=3, attn="eager")
    prompt = torch.tensor([[2, 8, 9, 10, 11]])
    parents = torch.tensor([-1, -1, 0, 0, 1, 2, 4])
    tokens = torch.tensor([20, 21, 22, 23, 24, 25, 26])
    depths = torch.tensor([1, 1, 2, 2, 2, 3, 3])
    tree = Tree(tokens, parents, depths, torch.ones(7))
    cache = new_cache(t.model)
    t.forward(prompt[:, :-1], past_key_values=cache, layer_ids=())
    out, _ = loop.verify(t, cache, [11], [tree], [0], [4])
    for i in range(-1, 7):
        path, j = [], i
        while j >= 0:
            path.insert(0, int(tokens[j]))
            j = int(parents[j])
        seq = torch.cat([prompt, torch.tensor([path], dtype=torch.long)], 1)
        ref = t.model(seq).logits[0, -1]
        torch.testing.assert_close(out.logits[0, i + 1], ref, atol=1e-5, rtol=1e-5)


def watch_cache(monkeypatch, target, tol):
    """After every step of decode.generate, each live row's cache slots must equal a fresh forward over its
    text (its prompt and every emitted token but the last), and the cache must be as long as its longest row.
    One sequence is a row like any other. Returns the rows checked, one entry per (step, row)."""
    checks = []
    prefill, step, keep = loop.Decoder.prefill, loop.Decoder.step, loop.Decoder.keep

    def watched_prefill(self, ids, starts):
        roots = prefill(self, ids, starts)
        self.texts = [ids[b, s:].tolist() + [r] for b, (s, r) in enumerate(zip(starts, roots))]
        return roots

    def watched_keep(self, rows):
        keep(self, rows)
        self.texts = [self.texts[b] for b in rows]

    def watched_step(self, roots, max_depths):
        steps, *seconds = step(self, roots, max_depths)
        slots = cache_entries(self.cache)
        assert cache_length(self.cache) == max(self.lengths)
        for b, s in enumerate(steps):
            self.texts[b] += s.emitted
            fresh = new_cache(target.model)
            target.forward(torch.tensor([self.texts[b][:-1]]), past_key_values=fresh, layer_ids=())
            assert self.lengths[b] - self.starts[b] == len(self.texts[b]) - 1
            for (k, v), (fk, fv) in zip(slots, cache_entries(fresh)):
                got = slice(self.starts[b], self.lengths[b])
                torch.testing.assert_close(k[b:b + 1, :, got], fk, atol=tol, rtol=tol)
                torch.testing.assert_close(v[b:b + 1, :, got], fv, atol=tol, rtol=tol)
            checks.append(b)
        return (steps, *seconds)

    monkeypatch.setattr(loop.Decoder, "prefill", watched_prefill)
    monkeypatch.setattr(loop.Decoder, "step", watched_step)
    monkeypatch.setattr(loop.Decoder, "keep", watched_keep)
    return checks


@pytest.mark.parametrize("drafter", ["eagle3", "self", "chain", "model_tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decode_kv_keep_equals_fresh_forward(drafter, temperature, monkeypatch):
    """After every step the target cache equals a fresh forward over the accepted text (fp32, 1e-5)."""
    t = tiny_target(vocab_size=64, layers=3)
    small = tiny_target(seed=1, vocab_size=64, layers=2)
    dr = {"eagle3": tiny_head(t, "eagle3", 48), "self": t, "chain": small,
          "model_tree": ModelTreeDrafter(t, small, TreeSpec(**TREE))}[drafter]
    checked = watch_cache(monkeypatch, t, 1e-5)
    out = decode.generate(t, dr, torch.tensor([PROMPTS[0]]), 24, temperature=temperature, seed=0,
                          eos_token_id=False, tree=TREE, gamma=3)
    assert len(checked) == len(out.stats.accept_lengths) >= 6
    if drafter == "self":
        assert max(out.stats.accept_lengths) == 4  # the keep moved multi-token paths


def test_decode_kv_keep_moves_non_contiguous_rows():
    t = tiny_target(vocab_size=64, layers=2)
    cache = new_cache(t.model)
    t.forward(torch.arange(2, 12)[None], past_key_values=cache, layer_ids=())
    before = [k.clone() for k, _ in cache_entries(cache)]
    assert keep_accepted(cache, 4, [4], [torch.tensor([0, 2, 5])]) == [7]
    for b, (k, _) in zip(before, cache_entries(cache)):
        assert k.shape[-2] == 7
        torch.testing.assert_close(k, b[..., [0, 1, 2, 3, 4, 6, 9], :], atol=0, rtol=0)


def test_decode_eos_and_stop_strings():
    t = tiny_target(vocab_size=64, layers=2)
    free = decode.generate(t, None, torch.tensor([PROMPTS[0]]), 16, eos_token_id=False)
    free = free.sequences[0, 4:].tolist()
    eos = free[5]
    out = decode.generate(t, t, torch.tensor([PROMPTS[0]]), 16, eos_token_id=eos, gamma=3)
    assert out.sequences[0, 4:].tolist() == free[: free.index(eos) + 1]
    # drafting for itself every node is accepted; the EOS cut the last step short, which is not a rejection
    assert out.stats.accept_lengths[-1] < out.stats.path_lengths[-1] == 4
    assert out.stats.acceptance_per_depth == [1.0, 1.0, 1.0]
    text = t.tokenizer.decode(free[:7])
    out = decode.generate(t, None, torch.tensor([PROMPTS[0]]), 16, eos_token_id=False, stop=text[-2:])
    assert t.tokenizer.decode(out.sequences[0, 4:]).endswith(text[-2:])


def test_decode_bad_input():
    t = tiny_target(vocab_size=64, layers=2)
    other = tiny_target(vocab_size=48, layers=2)
    with pytest.raises(ValueError, match="empty prompt"):
        decode.generate(t, None, torch.zeros(1, 0, dtype=torch.long), 4)
    with pytest.raises(ValueError, match=r"must be \[1, T\]"):
        decode.generate(t, None, torch.ones(1, 2, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="no rows"):
        decode.generate(t, None, torch.zeros(0, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="exceeds the target's context of 256"):
        decode.generate(t, None, torch.ones(1, 250, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="not trained for this target"):
        decode.generate(t, tiny_head(other, "eagle3", 32), torch.tensor([PROMPTS[0]]), 4)
    with pytest.raises(ValueError, match="does not share the tokenizer"):
        decode.generate(t, other, torch.tensor([PROMPTS[0]]), 4)
    decode.generate(other, other, torch.tensor([PROMPTS[0]]), 2)  # a pair found equal is remembered...
    for _ in range(2):  # ...but only for that pair: the same draft against another target is still refused
        with pytest.raises(ValueError, match="does not share the tokenizer"):
            decode.generate(t, other, torch.tensor([PROMPTS[0]]), 4)
    out = decode.generate(t, t, torch.tensor([PROMPTS[0]]), 0)  # documented: the prompt unchanged
    assert out.sequences.tolist() == [PROMPTS[0]] and out.stats.accept_lengths == []
    with pytest.raises(ValueError, match="TreeSpec"):
        TreeSpec(depth=0)
    # a tree spelled as the CLIs spell it: the same decoding as its TreeSpec; a malformed one named
    head = tiny_head(t, "eagle3", 32)
    spelled = decode.generate(t, head, torch.tensor([PROMPTS[0]]), 6, tree="2,2,3")
    assert spelled.sequences.tolist() == decode.generate(t, head, torch.tensor([PROMPTS[0]]), 6,
                                                         tree=TreeSpec(2, 2, 3)).sequences.tolist()
    assert max(spelled.stats.tree_sizes) == 3
    with pytest.raises(ValueError, match=r"tree='2,2': expected 'auto' or 'depth,top_k,total_tokens'"):
        decode.generate(t, head, torch.tensor([PROMPTS[0]]), 4, tree="2,2")


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_decode_tree_draft_probs_equal_sequential_head(kind):
    """Every tree node's draft probability equals running the head along that node's path alone
    (checks the head's tree mask, positions, feature feedback and d2t mapping)."""
    from eaglekit.decode.drafters import EagleDrafter
    from eaglekit.heads import HeadCache

    t = tiny_target(vocab_size=64, layers=3)
    head = tiny_head(t, kind, 48)
    head.lm_head.weight.data.mul_(30) if kind == "eagle3" else None  # peaky q: distinct candidates
    dr = EagleDrafter(t, head, TreeSpec(depth=4, top_k=3, total_tokens=20))
    prompt = torch.tensor([PROMPTS[2]])
    out = t.forward(prompt, layer_ids=dr.layer_ids)
    dr.prefill(prompt, out, 12)
    ids0, g0 = (x.clone() for x in dr.proposer.pending)
    tree = dr.draft(max_depth=10)
    assert len(tree) == 20 and int(tree.depths.max()) >= 3 and dr.proposer.length == len(ids0)
    to_draft = head.target_to_draft
    for v in range(len(tree)):
        path, j = [], v
        while j >= 0:
            path.insert(0, j)
            j = int(tree.parents[j])
        cache = HeadCache()
        pos = torch.arange(len(ids0))
        h, lg = head.step(ids0[None], g0[None], pos[None], cache=cache)
        h, lg = h[:, -1:], lg[:, -1:]
        for d, node in enumerate(path):
            q = torch.softmax(lg[0, -1].float(), -1)[to_draft(tree.tokens[node:node + 1])[0]]
            if node == v:
                torch.testing.assert_close(q, tree.q_token[v], atol=1e-5, rtol=1e-4)
                break
            pos = torch.tensor([[len(ids0) + d]])
            h, lg = head.step(tree.tokens[node:node + 1][None], h, pos, cache=cache)


def test_decode_near_tie_rule_fails_a_real_difference():
    """The real-model tests' near-tie escape must not excuse an ordinary wrong token."""
    from test_decode_real import assert_same_or_near_tie

    t = tiny_target(vocab_size=64, layers=2)
    t.lm_head.weight.data.mul_(20.0)  # clear top-2 gaps
    ref = hf_greedy(t, PROMPTS[0], 8)
    bad = ref.clone()
    bad[0, 7] = (bad[0, 7] + 1) % 64
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_same_or_near_tie(t, ref, bad, "tiny")
    assert assert_same_or_near_tie(t, ref, ref.clone(), "tiny") == 0
