"""The acceptance step alone (``decode.verify.accept``) on fixed verify logits, 20k draws, T=0.7, top_p=0.8,
top_k=5: the first emitted token must follow p_root, and the second (when the walk went deeper) p at the
accepted child, against exact_law.py's distributions (transformers' warpers, float64; chi-square summed
over the conditionals, ALPHA = 1e-3 per check). Each correct-rule check is paired with deliberately wrong
rules that the same check must reject. The wrong and lazy rules here are also used by the end-to-end
checks (test_decode_sampling_checks.py)."""
import pytest
import torch
from exact_law import ALPHA, chi2_pvalue, hf_probs

from eaglekit.decode.drafters import Tree
from eaglekit.decode.loop import Sampling, accept, accept_deterministic, accept_minpq_on_topk, accept_sampled

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest

CFG = {"temperature": 0.7, "top_p": 0.8, "top_k": 5}


# ---------------------------------------------------------------- wrong rules (each must be caught)

def no_renormalise(p, tokens, q_token, q_full, generator):
    """Accept x w.p. the ORIGINAL p(x), never renormalising after rejections (biased)."""
    p0 = p / p.sum()
    p = p.clone()
    for i, x in enumerate(tokens):
        if float(torch.rand((), generator=generator)) < float(p0[x]):
            return i, p
        p[x] = 0.0
    return None, (p if float(p.sum()) > 0 else p0)


def residual_keeps_rejected(p, tokens, q_token, q_full, generator):
    """Correct accept probabilities but the all-rejected sample is drawn from the untouched p (biased)."""
    i, _ = accept_deterministic(p, tokens, q_token, q_full, generator)
    return i, p


def reject_everything(p, tokens, q_token, q_full, generator):
    """Lossless but useless: caught only by the tau checks."""
    return None, p


def leviathan_one_hot_residual(p, tokens, q_token, q_full, generator):
    """min(1, p/q) but on rejection only x is removed from p (the top-k residual) (biased)."""
    i, _ = accept_sampled(p, tokens, q_token, q_full, generator)
    if i is not None:
        return i, p
    p = p.clone()
    p[tokens] = 0.0
    return None, p


def leviathan_residual_is_p(p, tokens, q_token, q_full, generator):
    """min(1, p/q) but resampling from p instead of norm(max(p - q, 0)) (biased)."""
    i, _ = accept_sampled(p, tokens, q_token, q_full, generator)
    return i, p / p.sum()


# ---------------------------------------------------------------- acceptance step alone

def _synthetic(seed, V=12):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, V, generator=g) * 2.5


def _draws(logits_of, tree_of, rule, n, seed):
    s, g = Sampling(**CFG), torch.Generator().manual_seed(seed)
    firsts, seconds, lengths = {}, {}, []
    for _ in range(n):
        tree, logits = tree_of(g), logits_of
        if callable(logits):
            logits = logits(tree)
        path, nxt = accept(logits, tree, s, g, rule)
        em = tree.tokens[path].tolist() + [nxt]
        firsts[em[0]] = firsts.get(em[0], 0) + 1
        if len(em) >= 2:
            seconds.setdefault(em[0], {})
            seconds[em[0]][em[1]] = seconds[em[0]].get(em[1], 0) + 1
        lengths.append(len(em))
    return firsts, seconds, lengths


def _as_dict(p):
    return {i: float(v) for i, v in enumerate(p) if v > 0}


def test_decode_accept_topk_tree_exact_law():
    """Top-k tree (root children = the 3 best of the draft, each with 2 children): first token ~ p_root,
    second ~ p_child. Candidates include tokens outside the target's support (p=0)."""
    lg = _synthetic(0)
    p = [hf_probs(r, CFG) for r in lg]
    order0 = lg[0].argsort(descending=True)
    kids0 = [int(order0[1]), int(order0[0]), int(order0[7])]  # 2nd best first; one token with p = 0
    tokens, parents = list(kids0), [-1, -1, -1]
    for c in range(3):  # each root child gets 2 children: its best and a p=0 one
        o = lg[1 + c].argsort(descending=True)
        tokens += [int(o[0]), int(o[9])]
        parents += [c, c]
    depths = [1] * 3 + [2] * 6
    tree = Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.full((9,), 0.5))
    logits = torch.cat([lg[:4], lg[4:].repeat(2, 1)[:6]])  # rows: root, 3 children, 6 grandchildren
    p_row = {c: p[1 + c] for c in range(3)}

    def law(rule, n=12000, seed=1):
        firsts, seconds, lengths = _draws(logits, lambda g: tree, rule, n, seed)
        groups = [(firsts, _as_dict(p[0]))]
        for c, x in enumerate(kids0):
            groups.append((seconds.get(x, {}), _as_dict(p_row[c])))
        return chi2_pvalue(groups), lengths

    pv, lengths = law(accept_deterministic)
    assert pv > ALPHA, pv
    assert sum(l >= 2 for l in lengths) > 3000 and max(lengths) == 3  # depth 2 really walked
    for wrong in (no_renormalise, residual_keeps_rejected, accept_minpq_on_topk):
        assert law(wrong, n=4000)[0] < ALPHA, wrong.__name__


def test_decode_accept_leviathan_chain_exact_law():
    """A sampled chain x1 ~ q0, x2 ~ q1[x1]; p at row 1 depends on x1. First ~ p0, second | x1 ~ p1[x1]."""
    V = 12
    lg = _synthetic(1, V)
    p0 = hf_probs(lg[0], CFG)
    qlog = lg + _synthetic(2, V)  # a draft near the target: supports overlap, ratios far from 1
    s = Sampling(**CFG)
    q0 = s.probs(qlog[0])
    row1 = torch.stack([lg[1] + 0.5 * torch.roll(lg[2], x) for x in range(V)])  # target p at x1
    q1 = torch.stack([s.probs(row1[x] + qlog[1] - lg[1]) for x in range(V)])  # q at depth 2 depends on x1
    p1 = {x: hf_probs(row1[x], CFG) for x in range(V)}

    def tree_of(g):
        x1 = int(torch.multinomial(q0, 1, generator=g))
        x2 = int(torch.multinomial(q1[x1], 1, generator=g))
        qf = torch.stack([q0, q1[x1]])
        return Tree.chain(torch.tensor([x1, x2]), torch.tensor([float(q0[x1]), float(q1[x1, x2])]), qf, True)

    def logits_of(tree):
        x1 = int(tree.tokens[0])
        return torch.stack([lg[0], row1[x1], lg[3]])

    def law(rule, n=12000, seed=3):
        firsts, seconds, lengths = _draws(logits_of, tree_of, rule, n, seed)
        return chi2_pvalue([(firsts, _as_dict(p0))] + [(seconds[x], _as_dict(p1[x])) for x in seconds]), lengths

    pv, lengths = law(accept_sampled)
    assert pv > ALPHA, pv
    assert sum(l >= 2 for l in lengths) > 1200
    for wrong in (leviathan_residual_is_p, leviathan_one_hot_residual):
        assert law(wrong, n=4000)[0] < ALPHA, wrong.__name__
    # NB the one-hot rule (accept x w.p. p(x), else p without x) is lossless for ANY single proposal chosen
    # independently of the coin, sampled ones included (only less efficient): it must pass here too.
    assert law(accept_deterministic, n=4000)[0] > ALPHA
