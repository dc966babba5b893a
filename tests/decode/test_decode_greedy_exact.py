"""Greedy exactness (temperature 0, and top-k=1): adversarial drafters, tiny budgets, EOS inside an
accepted run, every attention backend and dtype for the tree mask, and the head's own cache after every
step. Reference = the target's own decoding (transformers' generate), fp32.

The drafters written here follow the decode protocol (``prefill/draft/commit``) and ask the *target*
for their proposals, so their acceptance is known in advance: an oracle that proposes the target's
argmax must have every node on its path accepted (tau maximal), a drafter that proposes the argmin
must have nothing accepted (tau = 1). Both must still produce the target's own output."""
import pytest
import torch
from helpers import tiny_target
from test_decode_core import tiny_head

from eaglekit import decode
from eaglekit.decode import loop
from eaglekit.decode.drafters import EagleDrafter, Tree, TreeSpec
from eaglekit.decode.loop import Sampling
from eaglekit.target import new_cache

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest

PROMPTS = [[2, 8, 9, 10], [2, 30, 31, 32, 33], [2, 11]]
TREE = {"depth": 3, "top_k": 3, "total_tokens": 8}


class OracleDrafter:
    """Proposes a tree computed from the target itself (sequential forwards, memoised by context).

    ``choose(p, logits) -> list of token ids`` picks a node's children from the target's distribution
    ``p`` (after the sampling warpers) at that node. BFS order, so parents come before children.
    ``ignore_max_depth``: draft ``depth`` levels even past max_new_tokens (a protocol-breaking drafter
    the loop must still truncate)."""

    layer_ids = ()

    def __init__(self, target, sampling: Sampling, depth: int, choose, ignore_max_depth=False):
        self.target, self.sampling, self.depth, self.choose = target, sampling, depth, choose
        self.ignore_max_depth = ignore_max_depth
        self.memo: dict[tuple, torch.Tensor] = {}

    def logits(self, ctx: tuple) -> torch.Tensor:
        if ctx not in self.memo:
            self.memo[ctx] = self.target.model(torch.tensor([list(ctx)])).logits[0, -1].float()
        return self.memo[ctx]

    def prefill(self, prompt, out, root):
        self.ctx = tuple(prompt[0].tolist()) + (root,)

    def commit(self, tree, path, next_token, out, rows):
        self.ctx += tuple(tree.tokens[path].tolist()) + (next_token,)

    @torch.no_grad()
    def draft(self, max_depth: int) -> Tree:
        depth = self.depth if self.ignore_max_depth else min(self.depth, max_depth)
        tokens, parents, depths, frontier = [], [], [], [(-1, ())]
        for d in range(1, depth + 1):
            nxt = []
            for parent, suffix in frontier:
                lg = self.logits(self.ctx + suffix)
                for x in self.choose(self.sampling.probs(lg), lg):
                    tokens.append(int(x))
                    parents.append(parent)
                    depths.append(d)
                    nxt.append((len(tokens) - 1, suffix + (int(x),)))
            frontier = nxt
        n = len(tokens)
        return Tree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                    torch.tensor(depths, dtype=torch.long), torch.ones(n))


def argmax_second(p, lg):
    """Two children per node; the target's argmax is the SECOND sibling (the walk must look past the first)."""
    order = lg.argsort(descending=True)
    return [int(order[1]), int(order[0])]


def argmin_only(p, lg):
    return [int(lg.argmin()), int(lg.argsort()[1])]  # never the argmax


def hf_greedy(target, ids, n, eos=None):
    return target.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                                 pad_token_id=0).tolist()


def run(target, drafter, ids, n, **kw):
    kw.setdefault("eos_token_id", False)
    return decode.generate(target, drafter, torch.tensor([ids]), n, tree=kw.pop("tree", TREE),
                           gamma=kw.pop("gamma", 3), **kw)


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "eager")])
def test_decode_greedy_oracle_tau_max_and_wrong_tau_one(arch, attn):
    t = tiny_target(arch, attn=attn, vocab_size=64, layers=2)
    greedy = Sampling()
    for ids in PROMPTS[:1]:
        ref = hf_greedy(t, ids, 14)
        good = run(t, OracleDrafter(t, greedy, 3, argmax_second), ids, 14)
        assert good.sequences.tolist() == ref, (arch, attn, ids)
        # every verify accepts the whole drafted path: accept length = tree depth + 1, every step
        assert good.stats.accept_lengths == [d + 1 for d in good.stats.tree_depths], good.stats.accept_lengths
        assert good.stats.accept_lengths[0] == 4 and len(good.stats.accept_lengths) == 4  # 1 + 4+4+4+1
        bad = run(t, OracleDrafter(t, greedy, 3, argmin_only), ids, 14)
        assert bad.sequences.tolist() == ref, (arch, attn, ids)
        assert bad.stats.accept_lengths == [1] * 13 and max(bad.stats.tree_sizes) == 14


@pytest.mark.parametrize("n", [1, 2, 4])
def test_decode_greedy_tiny_budgets_every_drafter(n):
    t = tiny_target(vocab_size=64, layers=2)
    greedy = Sampling()
    drafters = {"plain": None, "chain": tiny_target(seed=1, vocab_size=64, layers=1), "self": t,
                "eagle3": tiny_head(t, "eagle3", 48), "eagle1": tiny_head(t, "eagle1"),
                "oracle": OracleDrafter(t, greedy, 4, argmax_second),
                "oracle_overshoot": OracleDrafter(t, greedy, 4, argmax_second, ignore_max_depth=True)}
    for ids in PROMPTS[1:]:
        ref = hf_greedy(t, ids, n)
        for name, dr in drafters.items():
            out = run(t, dr, ids, n, gamma=4, tree={"depth": 4, "top_k": 2, "total_tokens": 6})
            assert out.sequences.tolist() == ref, (name, ids, n)
            assert out.stats.new_tokens == n, (name, n)
            if name != "oracle_overshoot":
                assert 1 + sum(out.stats.accept_lengths) == n, (name, out.stats.accept_lengths)


@pytest.mark.parametrize("spec", [{"depth": 1, "top_k": 1, "total_tokens": 1}, {"depth": 5, "top_k": 1, "total_tokens": 1},
                                  {"depth": 6, "top_k": 1, "total_tokens": 6}, {"depth": 2, "top_k": 6, "total_tokens": 36}])
def test_decode_greedy_degenerate_tree_shapes(spec):
    t = tiny_target(vocab_size=64, layers=2, attn="eager")
    head = tiny_head(t, "eagle3", 40)
    for ids in PROMPTS[1:]:
        out = run(t, head, ids, 12, tree=spec)
        assert out.sequences.tolist() == hf_greedy(t, ids, 12), (spec, ids)
        assert max(out.stats.tree_sizes) <= spec["total_tokens"]


def test_decode_greedy_eos_inside_accepted_run():
    """EOS emitted in the middle of a fully accepted path: output stops right after it, as plain decoding."""
    t = tiny_target(vocab_size=64, layers=2)
    greedy = Sampling()
    ids = PROMPTS[0]
    free = hf_greedy(t, ids, 16)[0][len(ids):]
    cases = 0
    for j in range(len(free)):
        eos = free[j]
        if eos in free[:j]:
            continue
        ref = hf_greedy(t, ids, 16, eos=eos)
        assert ref[0][len(ids):] == free[: j + 1]
        for dr in (OracleDrafter(t, greedy, 4, argmax_second), t, tiny_head(t, "eagle3", 48), None):
            out = run(t, dr, ids, 16, eos_token_id=eos, gamma=4)
            assert out.sequences.tolist() == ref, (j, dr)
            assert out.stats.new_tokens == j + 1
        cases += 1
        if cases == 4:
            break
    assert cases == 4  # EOS at the root (j=0) and inside runs of the oracle (accept length 5 per step)


def test_decode_greedy_topk1_and_tiny_top_p_sampling_is_greedy():
    """At T>0 with top_k=1 (or top_p tiny) p is one-hot: every drafter must give the greedy output."""
    t = tiny_target(vocab_size=64, layers=2)
    chain = tiny_target(seed=1, vocab_size=64, layers=1)
    head = tiny_head(t, "eagle3", 48)
    for cfg in ({"temperature": 0.7, "top_k": 1}, {"temperature": 1.5, "top_p": 1e-6}):
        s = Sampling(**cfg)
        for ids in PROMPTS[:1]:
            ref = hf_greedy(t, ids, 12)
            for dr in (None, chain, head, OracleDrafter(t, s, 3, argmax_second)):
                out = run(t, dr, ids, 12, seed=123, **cfg)
                assert out.sequences.tolist() == ref, (cfg, dr)


def _path_forward_logits(t, prompt, tree):
    rows = []
    for i in range(-1, len(tree)):
        path, j = [], i
        while j >= 0:
            path.insert(0, int(tree.tokens[j]))
            j = int(tree.parents[j])
        seq = torch.cat([prompt, torch.tensor([path], dtype=torch.long)], 1)
        rows.append(t.model(seq).logits[0, -1].float())
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("qwen2", "eager")])
def test_decode_greedy_tree_verify_every_backend_and_dtype(arch, attn, dtype):
    """Verify-forward logits of every tree row equal a plain forward over prefix + its path; finite.
    bf16 tolerance 0.1 (logits ~N(0, 4)): a causal mask instead of the tree mask must exceed it."""
    t = tiny_target(arch, attn=attn, vocab_size=64, layers=2)
    t.lm_head.weight.data.mul_(20.0)
    t.model.to(dtype)
    prompt = torch.tensor([[2, 8, 9, 10, 11, 12]])
    parents = torch.tensor([-1, -1, -1, 0, 0, 1, 3, 3, 5])
    tree = Tree(torch.tensor([20, 21, 22, 23, 24, 25, 26, 27, 28]), parents,
                torch.tensor([1, 1, 1, 2, 2, 2, 3, 3, 3]), torch.ones(9))
    cache = new_cache(t.model)
    t.forward(prompt[:, :-1], past_key_values=cache, layer_ids=())
    out, _ = loop.verify(t, cache, [12], [tree], [0], [5])
    got = out.logits[0].float()
    ref = _path_forward_logits(t, prompt, tree)
    assert torch.isfinite(got).all()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert (got - ref).abs().max() < tol, (got - ref).abs().max()
    # the check can fail: a plain causal forward over the same rows is far off on some row
    cache2 = new_cache(t.model)
    t.forward(prompt[:, :-1], past_key_values=cache2, layer_ids=())
    wrong = t.forward(torch.cat([prompt[:, -1:], tree.tokens[None]], 1), past_key_values=cache2,
                      layer_ids=()).logits[0].float()
    assert (wrong - ref).abs().max() > 10 * tol


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_decode_greedy_head_cache_equals_fresh_every_step(kind):
    """At each draft, the head's cache holds exactly the elements (g_t, x_{t+1}) of the accepted text with
    the target's own features: equal (1e-5) to a fresh head run over the whole text. Tree elements and the
    bonus token must not linger; the tree below must be the same as from a fresh cache."""
    from eaglekit.heads import HeadCache

    t = tiny_target(vocab_size=64, layers=3)
    head = tiny_head(t, kind, 48)
    head.lm_head.weight.data.mul_(10.0) if kind == "eagle3" else None
    ed = EagleDrafter(t, head, TreeSpec(depth=3, top_k=3, total_tokens=8))
    text, checks = [], []

    class Checked:
        layer_ids = ed.layer_ids

        def prefill(self, prompt, out, root):
            text[:] = prompt[0].tolist() + [root]
            ed.prefill(prompt, out, root)

        def commit(self, tree, path, next_token, out, rows):
            text.extend(tree.tokens[path].tolist() + [next_token])
            ed.commit(tree, path, next_token, out, rows)

        def draft(self, max_depth):
            tree = ed.draft(max_depth)
            x = torch.tensor([text])
            fo = t.forward(x[:, :-1], layer_ids=ed.layer_ids)
            g = head.fuse_output(fo)
            fresh = HeadCache()
            head.step(x[:, 1:], g, torch.arange(x.shape[1] - 1)[None], cache=fresh)
            cache = ed.proposer.cache
            assert cache.length == fresh.length == len(text) - 1
            for a, b in zip(cache.keys + cache.values, fresh.keys + fresh.values):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            checks.append(len(tree))
            return tree

    out = run(t, Checked(), PROMPTS[0], 20, gamma=3)
    ref = hf_greedy(t, PROMPTS[0], 20)
    assert out.sequences.tolist() == ref
    assert len(checks) == len(out.stats.accept_lengths) >= 5


