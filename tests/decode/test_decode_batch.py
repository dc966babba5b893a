"""Batched decoding on tiny random models: every row equals the target's own unbatched greedy decoding of
its prompt (prompts of different lengths, rows ending at different steps, every drafter), the target's
KV cache of every row equals a fresh forward after every step, finished rows leave the batch, B = 1 is
the one-sequence loop's output, the sampling law holds per row, bad input is refused. Real targets:
test_decode_batch_real.py."""
import pytest
import torch
from exact_law import ALPHA, acceptance_rule, chi2_pvalue, exact_joint, sample_counts_batch
from helpers import tiny_target
from test_decode_core import TREE, tiny_head, watch_cache
from test_decode_greedy_exact import OracleDrafter, argmax_second
from test_decode_sampling import CONFIG, peaky_target

from eaglekit import decode
from eaglekit.decode import loop
from eaglekit.decode.draft_model import ModelTreeDrafter
from eaglekit.decode.drafters import TreeSpec, catch_up
from eaglekit.decode.lookup import LookupDrafter
from eaglekit.decode.loop import Sampling, accept_minpq_on_topk
from eaglekit.decode.stats import BatchStats, DecodeStats
from eaglekit.target import TargetOutput, cache_entries, crop_cache, keep_accepted, new_cache, row_output

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest

PROMPTS = [[2, 8, 9, 10], [2, 20, 21], [2, 30, 31, 32, 33, 34, 35], [2, 11]]


def hf_row(target, ids, n, eos=None):
    """The target's own greedy decoding of one prompt alone (transformers), new tokens only."""
    out = target.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                                pad_token_id=0)
    return out[0, len(ids):].tolist()


def new_rows(out, n):
    """Each row's new tokens, the pads after its end removed (pad id 0 is never generated here: checked)."""
    width = out.sequences.shape[1] - n
    rows = []
    for b, row in enumerate(out.sequences[:, width:].tolist()):
        k = out.stats.rows[b].new_tokens
        assert row[k:] == [0] * (n - k), (b, row, k)
        rows.append(row[:k])
    return rows


def drafters(t, small):
    return {"plain": None, "chain": small, "self": t, "eagle3": tiny_head(t, "eagle3", 48),
            "eagle1": tiny_head(t, "eagle1"), "model_tree": ModelTreeDrafter(t, small, TreeSpec(**TREE)),
            "lookup": LookupDrafter(None, 3), "eagle3_lookup": LookupDrafter(decode.EagleDrafter(
                t, tiny_head(t, "eagle3", 48), TreeSpec(**TREE)), (2, 3, 4)),
            "oracle": [OracleDrafter(t, Sampling(), 3, argmax_second) for _ in PROMPTS]}


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa")])
def test_decode_batch_greedy_rows_equal_unbatched(arch, attn):
    """Row b = the target's greedy decoding of prompt b alone, for every drafter; an EOS taken from one
    row's own output ends the rows at different steps (one at the prefill's token, others by max)."""
    t = tiny_target(arch, attn=attn, vocab_size=64, layers=3)
    t.lm_head.weight.data.mul_(3.0)  # fewer near-ties in a tiny random model
    small = tiny_target(arch, seed=1, vocab_size=64, layers=2, attn=attn)
    n = 16
    free = [hf_row(t, p, n) for p in PROMPTS]
    assert all(0 not in row for row in free)  # pad id 0 would hide a row's end
    eos = free[0][5] if free[0][5] not in free[0][:5] else free[0][6]
    refs = [hf_row(t, p, n, eos) for p in PROMPTS]
    assert len({len(r) for r in refs}) > 1, "rows must end at different steps"
    for name, dr in drafters(t, small).items():
        out = decode.generate(t, dr, PROMPTS, n, eos_token_id=eos, tree=TREE, gamma=3)
        assert new_rows(out, n) == refs, name
        assert out.sequences.shape == (4, 7 + n)
        lengths = [r.accept_lengths for r in out.stats.rows]
        if name in ("self", "oracle"):  # every drafted token is the target's own choice: all accepted
            assert all(a[:-1] == [4] * (len(a) - 1) for a in lengths if a), (name, lengths)
            assert all(r.path_lengths == [d + 1 for d in r.tree_depths] for r in out.stats.rows), name
        if name in ("eagle3", "eagle1", "model_tree"):
            assert max(max(r.tree_sizes) for r in out.stats.rows if r.tree_sizes) == TREE["total_tokens"]
    # the same batch as a left-padded tensor with its attention mask
    ids, mask = torch.zeros(4, 7, dtype=torch.long), torch.zeros(4, 7, dtype=torch.long)
    for b, p in enumerate(PROMPTS):
        ids[b, 7 - len(p):], mask[b, 7 - len(p):] = torch.tensor(p), 1
    out = decode.generate(t, tiny_head(t, "eagle3", 48), ids, n, attention_mask=mask, eos_token_id=eos, tree=TREE)
    assert new_rows(out, n) == refs and torch.equal(out.sequences[:, :7], ids)


def test_decode_batch_tau_is_mean_of_rows_and_rows_keep_their_steps():
    t = tiny_target(vocab_size=64, layers=2)
    out = decode.generate(t, t, PROMPTS[:3], 9, eos_token_id=False, gamma=3)
    rows = out.stats.rows
    assert [r.accept_lengths for r in rows] == [[4, 4]] * 3  # 1 from the prefill + 4 + 4
    assert out.stats.tau == pytest.approx(sum(r.tau for r in rows) / 3) and out.stats.forwards == 2
    assert out.stats.new_tokens == 27 and out.stats.accept_lengths == [4, 4] * 3


@pytest.mark.parametrize("drafter", ["eagle3", "self", "chain", "model_tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decode_batch_kv_equals_fresh_forward_per_row(drafter, temperature, monkeypatch):
    t = tiny_target(vocab_size=64, layers=3)
    small = tiny_target(seed=1, vocab_size=64, layers=2)
    dr = {"eagle3": tiny_head(t, "eagle3", 48), "self": t, "chain": small,
          "model_tree": ModelTreeDrafter(t, small, TreeSpec(**TREE))}[drafter]
    checks = watch_cache(monkeypatch, t, 1e-5)
    out = decode.generate(t, dr, PROMPTS[:3], 14, temperature=temperature, seed=0, eos_token_id=False, tree=TREE,
                          gamma=3)
    assert len(checks) == sum(len(r.accept_lengths) for r in out.stats.rows) >= 3 * 4
    if drafter == "self":
        assert max(out.stats.accept_lengths) == 4  # the keep moved multi-token paths


def test_decode_batch_kv_check_can_fail(monkeypatch):
    """A keep that forgets to move the accepted rows (only truncates) must fail the per-row check."""
    t = tiny_target(vocab_size=64, layers=2)
    watch_cache(monkeypatch, t, 1e-5)

    def lazy_keep(cache, past_len, lengths, rows, written=None):
        crop_cache(cache, past_len)
        return [n + len(r) for n, r in zip(lengths, rows)]
    monkeypatch.setattr(loop, "keep_accepted", lazy_keep)  # loop.Decoder.step calls it by that name
    with pytest.raises(AssertionError):
        decode.generate(t, t, PROMPTS[:2], 8, eos_token_id=False, gamma=3)


def test_decode_batch_keep_moves_each_rows_path():
    t = tiny_target(vocab_size=64, layers=2)
    cache = new_cache(t.model)
    t.forward(torch.arange(2, 22).view(2, 10), past_key_values=cache, layer_ids=())
    before = [k.clone() for k, _ in cache_entries(cache)]
    # row 0 held 4 slots, row 1 held 6; the last 4 slots are the verify rows
    lengths = keep_accepted(cache, 6, [4, 6], [torch.tensor([0, 2, 3]), torch.tensor([0])])
    assert lengths == [7, 7]
    for b, (k, _) in zip(before, cache_entries(cache)):
        assert k.shape[-2] == 7
        torch.testing.assert_close(k[0, :, :7], b[0, :, [0, 1, 2, 3, 6, 8, 9]], atol=0, rtol=0)
        torch.testing.assert_close(k[1, :, :7], b[1, :, [0, 1, 2, 3, 4, 5, 6]], atol=0, rtol=0)


def test_decode_batch_finished_rows_leave_the_batch(monkeypatch):
    """A row that ended gets no more rows in the verify forward; the others still finish exactly."""
    t = tiny_target(vocab_size=64, layers=2)
    n = 12
    free = [hf_row(t, p, n) for p in PROMPTS]
    eos = free[1][2]
    refs = [hf_row(t, p, n, eos) for p in PROMPTS]
    widths = []
    forward = type(t).forward
    monkeypatch.setattr(type(t), "forward", lambda self, ids, **kw: widths.append(ids.shape[0]) or
                        forward(self, ids, **kw))
    out = decode.generate(t, None, PROMPTS, n, eos_token_id=eos)
    assert new_rows(out, n) == refs
    live = [sum(len(r) > k for r in refs) for k in range(n)]  # rows still decoding after k tokens
    assert widths == live[: len(widths)] and widths[-1] < widths[0], (widths, live)


def test_decode_batch_of_one_is_the_one_sequence_loop(monkeypatch):
    t = tiny_target(vocab_size=64, layers=3)
    head = tiny_head(t, "eagle3", 48)
    ids = torch.tensor([PROMPTS[2]])
    for dr in (None, head, t):
        one = decode.generate(t, dr, ids, 12, eos_token_id=False, tree=TREE, gamma=3)
        as_list = decode.generate(t, dr, [PROMPTS[2]], 12, eos_token_id=False, tree=TREE, gamma=3)
        assert torch.equal(as_list.sequences, one.sequences)
        assert as_list.stats.rows[0].accept_lengths == one.stats.accept_lengths
        # the loop called with a list of one drafter (the batch layout) gives the same tokens and steps
        drafter = decode.make_drafter(t, dr, tree=TREE, gamma=3)
        forced = loop.run(t, [drafter], ids, 12, Sampling(), starts=[0])
        assert torch.equal(forced.sequences, one.sequences)
        assert forced.stats.rows[0].accept_lengths == one.stats.accept_lengths
        assert type(one.stats) is DecodeStats and isinstance(as_list.stats, BatchStats)
        assert as_list.stats.forwards == len(one.stats.accept_lengths) == len(as_list.stats.accept_lengths)
        assert as_list.stats.rows[0].total_s == as_list.stats.total_s > 0  # a lone row has the run's seconds
    widths = []  # the prefill of a left-padded batch of one: its prompt alone, under the model's causal mask
    forward = type(t).forward
    monkeypatch.setattr(type(t), "forward", lambda self, ids, **kw: widths.append(
        (ids.shape, kw.get("attention_mask") is None)) or forward(self, ids, **kw))
    padded = decode.generate(t, head, torch.tensor([[0, 0] + PROMPTS[1]]), 6, eos_token_id=False, tree=TREE,
                             attention_mask=torch.tensor([[0, 0, 1, 1, 1]]))
    assert widths[0] == ((1, 3), True)
    alone = decode.generate(t, head, torch.tensor([PROMPTS[1]]), 6, eos_token_id=False, tree=TREE)
    assert padded.sequences[0, :5].tolist() == [0, 0] + PROMPTS[1] and padded.sequences.shape == (1, 11)
    assert padded.sequences[0, 5:].tolist() == alone.sequences[0, 3:].tolist()
    assert padded.stats.rows[0].accept_lengths == alone.stats.accept_lengths


def test_decode_batch_sampling_law_per_row():
    """A batch of 3 different prompts, T=0.8 top-p 0.9 top-k 6, an EAGLE tree: each row's first 3 tokens
    follow the target's exact law for its own prompt; min(1, p/q) on top-k candidates fails the same check."""
    target = peaky_target(0)
    head = tiny_head(target, "eagle3", draft_vocab=12)
    head.lm_head.weight.data.mul_(20.0)
    prompts = [[2, 8, 9, 10], [2, 5], [2, 11, 3, 7, 12]]
    exact = [exact_joint(target, CONFIG, p) for p in prompts]
    tree = {"depth": 2, "top_k": 5, "total_tokens": 10}
    counts, stats = sample_counts_batch(target, head, CONFIG, 400, 1, prompts, 4, tree=tree)
    p = chi2_pvalue(list(zip(counts, exact)))
    assert p > ALPHA, p
    lengths = [a for s in stats for r in s.rows for a in r.accept_lengths]
    assert max(lengths) == 3 and sum(lengths) / len(lengths) > 1.1  # the walk went to depth 2
    with acceptance_rule(accept_minpq_on_topk):
        counts, _ = sample_counts_batch(target, head, CONFIG, 150, 1, prompts, 4, tree=tree)
    assert chi2_pvalue(list(zip(counts, exact))) < ALPHA


def test_decode_batch_bad_input():
    t = tiny_target(vocab_size=64, layers=2)
    ids = torch.tensor([[0, 2, 5], [2, 6, 7]])
    with pytest.raises(ValueError, match="row 0 must be 0 on left pads.*right-padded: .*padding_side = 'left'"):
        decode.generate(t, None, ids, 4, attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]))
    with pytest.raises(ValueError, match=r"row 1 must be 0 on left pads.*got \[0, 1, 0\]"):
        decode.generate(t, None, ids, 4, attention_mask=torch.tensor([[1, 1, 1], [0, 1, 0]]))
    long = torch.ones(2, 40, dtype=torch.long)
    long[1, 20] = 0  # a hole in a long row: the message shows its ends, not all 40
    with pytest.raises(ValueError, match=r"row 1 .*got \[1, 1, .*\.\.\. \(16 more\)") as err:
        decode.generate(t, None, long, 4, attention_mask=long.clone())
    assert len(str(err.value)) < 250
    with pytest.raises(ValueError, match="shape"):
        decode.generate(t, None, ids, 4, attention_mask=torch.ones(2, 2))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        decode.generate(t, None, [[2, 3], []], 4)
    with pytest.raises(ValueError, match="row 1 is all 0"):
        decode.generate(t, None, ids, 4, attention_mask=torch.tensor([[0, 1, 1], [0, 0, 0]]))
    with pytest.raises(ValueError, match="a streamer takes one sequence"):
        decode.generate(t, None, ids, 4, streamer=object())
    with pytest.raises(ValueError, match="3 drafters for a batch of 2"):
        decode.generate(t, [None] * 3, ids, 4)
    with pytest.raises(ValueError, match="2 drafters for a batch of 1"):
        decode.generate(t, [None] * 2, [[2, 3]], 4)
    with pytest.raises(TypeError, match="fork"):
        decode.generate(t, OracleDrafter(t, Sampling(), 2, argmax_second), ids, 4)
    with pytest.raises(ValueError, match="exceeds the target's context of 256"):
        decode.generate(t, None, [[2] * 250, [2]], 8)
    out = decode.generate(t, None, ids, 0)
    assert torch.equal(out.sequences, ids) and out.stats.rows[0].accept_lengths == []


def test_decode_batch_row_output_cuts_a_row():
    o = TargetOutput(torch.arange(2 * 1 * 3).view(2, 1, 3).float(), torch.arange(2 * 5 * 2).view(2, 5, 2).float(),
                     None)
    r = row_output(o, 1, slice(2, 5))
    assert r.last.tolist() == [o.last[1, 2:5].tolist()] and r.logits is None and r.taps is None
    picked = row_output(o, 0, torch.tensor([4, 0, 2]))
    assert picked.last.tolist() == [o.last[0, [4, 0, 2]].tolist()]


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_decode_batch_head_catch_up_of_rows_equals_alone(kind):
    """Rows of one head caught up in one forward (caches of different lengths, empty ones included, and
    different numbers of pending tokens) get the output and cache entries each would compute alone."""
    t = tiny_target(vocab_size=64, layers=3)
    head = tiny_head(t, kind, 48)
    together = [decode.EagleDrafter(t, head, TreeSpec(**TREE)).proposer for _ in PROMPTS]
    alone = [decode.EagleDrafter(t, head, TreeSpec(**TREE)).proposer for _ in PROMPTS]
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        for b, p in enumerate(PROMPTS):
            if step == 0:  # the prefill's pending elements: a whole prompt, an empty cache
                ids = torch.tensor([p])
                out = t.forward(ids, layer_ids=together[b].layer_ids)
                together[b].start(ids, out, 5 + b)
                alone[b].start(ids, out, 5 + b)
            else:  # accepted tokens with some features: 1 to 4 of them
                n = 1 + b
                pending = (torch.randint(7, 64, (n,), generator=g), torch.randn(n, 32, generator=g))
                together[b].pending = alone[b].pending = pending
        catch_up(together)
        for a, b in zip(together, alone):
            for x, y in zip(a.catch_up(), b.catch_up()):
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
            assert a.length == b.length
            for x, y in zip(a.cache.keys + a.cache.values, b.cache.keys + b.cache.values):
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert len({p.length for p in together}) >= 3  # ragged caches were exercised


def test_decode_batch_head_drafts_one_catch_up_forward_per_step(monkeypatch):
    """A depth-1 head tree in a batch: one head forward per verify step for all rows, not one per row."""
    t = tiny_target(vocab_size=64, layers=3)
    head = tiny_head(t, "eagle3", 48)
    calls = []
    step = type(head).step
    monkeypatch.setattr(type(head), "step", lambda self, *a, **kw: calls.append(a[0].shape[0]) or step(self, *a, **kw))
    out = decode.generate(t, head, PROMPTS, 10, eos_token_id=False, tree={"depth": 1, "top_k": 3, "total_tokens": 3})
    assert len(calls) == out.stats.forwards and calls[0] == len(PROMPTS)
