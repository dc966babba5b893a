"""The target's preallocated KV cache (RowsCache) and compile=True.

The cache: written in place (its buffers keep their address through a whole generation: no torch.cat per
step), crop and keep move a length, a full buffer doubles keeping its entries, static writes land at a tensor
offset and return the whole buffer. The static verify path (whole-buffer mask, trees padded to a bucket)
is checked eagerly against the target's own greedy decoding for every drafter kind, with
Target.compiled_forward replaced by the eager forward; then once through torch.compile (inductor, slow): a head
tree and plain decoding, B = 1 and B = 2, token-identical to the target's own greedy decoding. A model dynamo
cannot compile is one CompileError.
"""
import pytest
import torch
from helpers import tiny_target
from test_decode_batch import PROMPTS, drafters, hf_row, new_rows
from test_decode_core import TREE, tiny_head

from eaglekit import decode
from eaglekit.decode import loop
from eaglekit.target import (
    CompileError,
    Target,
    cache_length,
    crop_cache,
    keep_accepted,
    new_cache,
    static_writes,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def kv_pair(n: int, start: int = 0, B: int = 1, dim: int = 4):
    k = torch.arange(start, start + n, dtype=torch.float32)[None, None, :, None].expand(B, 2, n, dim).clone()
    return k, -k[..., :3]  # values narrower than keys, as MLA's


def test_cache_writes_in_place_crops_and_grows():
    cache = new_cache(capacity=8)
    k, v = cache.update(*kv_pair(3), 0)
    buf = cache.layers[0].keys
    assert buf.shape == (1, 2, 8, 4) and cache.layers[0].values.shape == (1, 2, 8, 3)
    assert k.shape[-2] == 3 and k.data_ptr() == buf.data_ptr()  # a view of the buffer, not a copy
    k, v = cache.update(*kv_pair(4, start=3), 0)
    assert cache.layers[0].keys is buf and cache_length(cache) == 7
    torch.testing.assert_close(k[0, 0, :, 0], torch.arange(7.0))
    torch.testing.assert_close(v[0, 1, :, 2], -torch.arange(7.0))
    crop_cache(cache, 2)  # a rollback moves the length; the next write lands at slot 2
    k, _ = cache.update(*kv_pair(2, start=40), 0)
    assert cache.layers[0].keys is buf
    torch.testing.assert_close(k[0, 0, :, 0], torch.tensor([0.0, 1.0, 40.0, 41.0]))
    k, _ = cache.update(*kv_pair(6, start=50), 0)  # 10 > 8: the buffers double, keeping their entries
    assert cache.layers[0].keys.shape[-2] == 16 and cache_length(cache) == 10
    torch.testing.assert_close(k[0, 0, :, 0], torch.tensor([0.0, 1.0, 40.0, 41.0, 50, 51, 52, 53, 54, 55]))


def test_static_writes_land_at_a_tensor_offset_and_return_the_whole_buffer():
    cache = new_cache(capacity=4)
    cache.update(*kv_pair(3), 0)
    at = torch.tensor(2)
    static_writes(cache, at, capacity=12)
    k, v = cache.update(*kv_pair(2, start=70), 0)
    assert k.shape[-2] == v.shape[-2] == 12  # the whole buffer: the caller's mask blocks the unused slots
    torch.testing.assert_close(k[0, 0, :4, 0], torch.tensor([0.0, 1.0, 70.0, 71.0]))
    at.fill_(5)  # the offset is a tensor: the next write moves with it
    k, _ = cache.update(*kv_pair(1, start=90), 0)
    assert k[0, 0, 5, 0] == 90 and cache_length(cache) == 3  # static writes leave the length to the caller
    static_writes(cache, None)
    assert cache.update(*kv_pair(1, start=99), 0)[0].shape[-2] == 4  # eager again: appended at the length


def test_keep_on_the_models_own_cache_crops_a_chain_and_refuses_a_tree():
    """The model's own cache (a target with recurrent or indexed layers decodes on it) keeps a prefix of what a
    verify forward wrote (a chain's accepted path: the rest cropped), and refuses the nodes of a tree."""
    from transformers import DynamicCache

    t = tiny_target(vocab_size=64, layers=2)
    cache = DynamicCache()
    t.model(input_ids=torch.arange(2, 7)[None], past_key_values=cache, use_cache=True)
    t.model(input_ids=torch.arange(7, 10)[None], past_key_values=cache, use_cache=True)  # a verify of 3 rows
    assert keep_accepted(cache, 5, [5], [torch.tensor([0, 1])], written=3) == [7]
    assert cache.get_seq_length() == 7  # the third verify row cropped
    for rows in ([torch.tensor([0, 2])], [torch.tensor([0, 1, 2, 3])]):
        with pytest.raises(RuntimeError, match="keeps a prefix of what a forward wrote.*not the nodes of a tree"):
            keep_accepted(cache, 5, [5], rows, written=3)


def test_decoding_never_reallocates_the_target_cache(monkeypatch):
    """One buffer per layer for a whole generation (sized from the prompt and max_new_tokens): a step that
    concatenated or regrew would give a new address."""
    t = tiny_target(vocab_size=64, layers=2)
    seen, step = [], loop.Decoder.step

    def watched(self, *a, **k):
        out = step(self, *a, **k)
        seen.append(tuple(layer.keys.data_ptr() for layer in self.cache.layers))
        return out
    monkeypatch.setattr(loop.Decoder, "step", watched)
    decode.generate(t, tiny_head(t, "eagle3"), torch.tensor([PROMPTS[0]]), 20, eos_token_id=False, tree=TREE)
    assert len(seen) >= 5 and len(set(seen)) == 1


def eager_compiled(monkeypatch):
    """Target.compiled_forward run eagerly: the static path's shapes, masks and writes without compiling."""
    def forward(self, ids, *, attention_mask, position_ids, past_key_values, layer_ids=(), mode=None):
        calls.append((ids.shape, attention_mask.shape[-1] if torch.is_tensor(attention_mask) else None))
        return self.forward(ids, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=past_key_values, layer_ids=layer_ids)
    calls = []
    monkeypatch.setattr(Target, "compiled_forward", forward)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_static_verify_rows_equal_the_targets_greedy(arch, monkeypatch):
    """The static path (keys = the whole buffer, trees padded to a bucket) for every drafter, rows of different
    lengths ending at different steps: each row is the target's own greedy decoding of its prompt."""
    calls = eager_compiled(monkeypatch)
    t = tiny_target(arch, vocab_size=64, layers=3)
    t.lm_head.weight.data.mul_(3.0)  # fewer near-ties in a tiny random model
    small = tiny_target(arch, seed=1, vocab_size=64, layers=2)
    n = 16
    free = [hf_row(t, p, n) for p in PROMPTS]
    eos = free[0][5] if free[0][5] not in free[0][:5] else free[0][6]
    refs = [hf_row(t, p, n, eos) for p in PROMPTS]
    for name, dr in drafters(t, small).items():
        calls.clear()
        out = decode.generate(t, dr, PROMPTS, n, eos_token_id=eos, tree=TREE, gamma=3, compile=True)
        assert new_rows(out, n) == refs, name
        assert calls and {q - 1 for (_, q), _ in calls} <= set(loop.BUCKETS), (name, calls)
        assert {k for _, k in calls} == {loop.capacity(7, n)}, name  # the whole buffer, every step
        one = decode.generate(t, dr if name != "oracle" else dr[0], torch.tensor([PROMPTS[2]]), n,
                              eos_token_id=eos, tree=TREE, gamma=3, compile=True)
        assert one.sequences[0, 7:].tolist() == refs[2], name


def test_static_verify_reads_the_device_at_most_twice_per_step(monkeypatch):
    from test_decode_host_syncs import reads_per_step

    eager_compiled(monkeypatch)
    t = tiny_target()
    counts = reads_per_step(monkeypatch, loop.Decoder)
    decode.generate(t, tiny_head(t, "eagle3"), PROMPTS[:3], 12, eos_token_id=False, tree=TREE, compile=True)
    assert counts and max(counts) <= 2, counts


def test_bucket_sizes():
    assert [loop.bucket(n) for n in (0, 1, 3, 8, 9, 40, 64, 65, 130)] == [0, 1, 4, 8, 16, 64, 64, 128, 256]


def test_a_model_dynamo_cannot_compile_is_one_clear_error():
    t = tiny_target(vocab_size=64, layers=2)
    t.layers[0].register_forward_pre_hook(lambda *a: torch._dynamo.graph_break())
    with pytest.raises(CompileError, match="cannot compile tiny-llama"):
        decode.generate(t, None, torch.tensor([PROMPTS[0]]), 4, eos_token_id=False, compile=True)


@pytest.mark.slow
def test_compiled_decoding_equals_the_targets_greedy():
    """torch.compile (inductor on the CPU): plain decoding and a head tree, one prompt and a batch of two, each
    token-identical to the target's own greedy decoding. Prompts of one length ending by max_new_tokens, and a
    one-level tree of siblings (bucket 4, then 0 on the last step): six graphs in all, one per (taps, rows,
    bucket)."""
    t = tiny_target(vocab_size=64, layers=2)
    t.lm_head.weight.data.mul_(3.0)
    head = tiny_head(t, "eagle3")
    prompts, n = [[2, 8, 9, 10], [2, 30, 31, 32]], 12
    refs = [hf_row(t, p, n) for p in prompts]
    for dr, tree in [(None, None), (head, {"depth": 1, "top_k": 4, "total_tokens": 4})]:
        one = decode.generate(t, dr, torch.tensor(prompts[:1]), n, eos_token_id=False, tree=tree, compile=True)
        assert one.sequences[0, 4:].tolist() == refs[0], dr
        both = decode.generate(t, dr, prompts, n, eos_token_id=False, tree=tree, compile=True)
        assert new_rows(both, n) == refs, dr
        if dr is not None:
            assert max(one.stats.tree_sizes) == 4  # the head's trees were verified, not skipped
