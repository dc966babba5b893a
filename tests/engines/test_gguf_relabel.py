"""eaglekit.engines.gguf_relabel: a Qwen2 GGUF rewritten as a llama GGUF (keys renamed, q/k rows from NEOX to NORM rotary
order, quantised rows moved whole). Fast: the file's contents, on a tiny random Qwen2 GGUF. Real: the same
tiny model in llama-server, original and relabelled, gives the same greedy tokens and the same top
log-probabilities, and without the row permutation it does not."""
import numpy as np
import pytest

from eaglekit.engines import gguf_relabel

HP = {"block_count": 2, "context_length": 256, "embedding_length": 64, "feed_forward_length": 96,
      "attention.head_count": 4, "attention.head_count_kv": 2}


def tiny_qwen2_gguf(path, tokenizer: dict | None = None, vocab: int = 300, seed: int = 0):
    """A random Qwen2 GGUF (2 layers, hidden 64, 4 heads / 2 KV heads of 16): f32 norms and biases, q8_0 q/k/v
    and MLP weights, f16 embedding tied to the output. ``tokenizer``: tokenizer.ggml.* fields to write."""
    import gguf

    rng = np.random.default_rng(seed)
    tok = tokenizer or {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [f"t{i}" for i in range(vocab)]}
    vocab = len(tok["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(path), "qwen2")
    for k, v in HP.items():
        w.add_uint32(f"qwen2.{k}", v)
    w.add_float32("qwen2.rope.freq_base", 10000.0)
    w.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
    for k, v in tok.items():
        if isinstance(v, list):
            sub = gguf.GGUFValueType.STRING if isinstance(v[0], str) else gguf.GGUFValueType.INT32
            w.add_key_value(k, v, gguf.GGUFValueType.ARRAY, sub_type=sub)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        else:
            w.add_string(k, v)
    H, F, hd = HP["embedding_length"], HP["feed_forward_length"], 16
    q8 = gguf.GGMLQuantizationType.Q8_0

    def rand(*shape, std=0.3):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(vocab, H, std=1.0).astype(np.float16))
    w.add_tensor("output_norm.weight", 1 + rand(H, std=0.1))
    for i in range(HP["block_count"]):
        shapes = {"attn_q": (4 * hd, H), "attn_k": (2 * hd, H), "attn_v": (2 * hd, H), "attn_output": (H, 4 * hd),
                  "ffn_gate": (F, H), "ffn_up": (F, H), "ffn_down": (H, F)}
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{i}.{name}.weight", gguf.quants.quantize(rand(*shape), q8), raw_dtype=q8)
        for name in ("attn_q", "attn_k", "attn_v"):
            w.add_tensor(f"blk.{i}.{name}.bias", rand(shapes[name][0], std=0.5))
        w.add_tensor(f"blk.{i}.attn_norm.weight", 1 + rand(H, std=0.1))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + rand(H, std=0.1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_neox_to_norm_interleaves_each_heads_halves():
    rows = np.arange(2 * 8)[:, None] * np.ones((1, 3))  # 2 heads of 8 rows, 3 columns
    out = gguf_relabel.neox_to_norm(rows, heads=2)
    for h in range(2):
        for i in range(4):
            assert (out[h * 8 + 2 * i] == rows[h * 8 + i]).all()
            assert (out[h * 8 + 2 * i + 1] == rows[h * 8 + 4 + i]).all()


def test_relabel_renames_keys_and_moves_quantised_rows_whole(tmp_path):
    from gguf import GGUFReader

    src = tiny_qwen2_gguf(tmp_path / "q.gguf")
    dst = gguf_relabel.relabel_qwen2_as_llama(src, tmp_path / "l.gguf")
    a, b = GGUFReader(str(src)), GGUFReader(str(dst))
    assert b.fields["general.architecture"].contents() == "llama"
    assert not [k for k in b.fields if k.startswith("qwen2.")]
    for k, v in HP.items():
        assert b.fields[f"llama.{k}"].contents() == v
    assert b.fields["tokenizer.ggml.tokens"].contents() == a.fields["tokenizer.ggml.tokens"].contents()
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert list(ta) == list(tb)
    for name, t in ta.items():
        assert tb[name].tensor_type == t.tensor_type and list(tb[name].shape) == list(t.shape)
        kind = name.split(".")[-2]
        if name.startswith("blk.") and kind in ("attn_q", "attn_k"):
            heads = HP["attention.head_count"] if kind == "attn_q" else HP["attention.head_count_kv"]
            d = t.data.shape[0] // heads
            for h in range(heads):  # row h*d + 2i is row h*d + i, byte for byte (a q8_0 row is whole blocks)
                for i in range(d // 2):
                    assert (tb[name].data[h * d + 2 * i] == t.data[h * d + i]).all()
                    assert (tb[name].data[h * d + 2 * i + 1] == t.data[h * d + d // 2 + i]).all()
            assert not (tb[name].data == t.data).all()
        else:
            assert (tb[name].data == t.data).all(), name
    llama = tmp_path / "again.gguf"
    with pytest.raises(ValueError, match="general.architecture is 'llama'"):
        gguf_relabel.relabel_qwen2_as_llama(dst, llama)
    assert not llama.exists()


@pytest.mark.real
def test_relabelled_qwen2_gives_the_same_logits_in_llama_server(tmp_path, monkeypatch):
    """The tiny random Qwen2 GGUF and its llama relabel, each in the pinned llama-server: the same greedy
    tokens, top-5 log-probabilities equal within 1e-4 at every position (the same arithmetic in another order:
    the llama graph adds the biases and rotates pairs instead of halves); relabelled without the permutation
    they differ (the check can fail)."""
    from eaglekit.engines import llama_cpp

    root = llama_cpp.require()
    # a byte-level BPE vocabulary llama.cpp loads, of ASCII pieces (a piece that is part of a UTF-8 character
    # would join the next token's log-probabilities in the server's answer); the prompt goes in as ids.
    # (Qwen's own 151k-token vocabulary made this test ~50 s of GGUF parsing; the arithmetic is the same)
    pieces = [f"t{i}" for i in range(512)]
    tok = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": pieces,
           "tokenizer.ggml.token_type": [1] * len(pieces), "tokenizer.ggml.merges": ["t 0"],
           "tokenizer.ggml.eos_token_id": 511, "tokenizer.ggml.bos_token_id": 510}
    src = tiny_qwen2_gguf(tmp_path / "q.gguf", tokenizer=tok)
    relabelled = gguf_relabel.relabel_qwen2_as_llama(src, tmp_path / "l.gguf")
    monkeypatch.setattr(gguf_relabel, "neox_to_norm", lambda rows, heads: rows)
    unpermuted = gguf_relabel.relabel_qwen2_as_llama(src, tmp_path / "u.gguf")
    prompt = [97, 11, 187, 0, 355, 374, 264, 127, 30, 108]
    outs = {}
    for name, model in (("qwen2", src), ("llama", relabelled), ("unpermuted", unpermuted)):
        with llama_cpp.Server(model, root=root, threads=1, ctx=128) as s:
            outs[name] = s.complete(prompt, 12, n_probs=5)
    ref = outs["qwen2"]
    assert len(ref.tokens) == 12 and len(ref.top) == 12

    def gap(out):  # over the positions both decoded (a wrong model may stop early on an end token)
        return max(abs(p[t] - q.get(t, -1e9)) for p, q in zip(ref.top, out.top) for t in p)

    assert outs["llama"].tokens == ref.tokens
    assert gap(outs["llama"]) < 1e-4, gap(outs["llama"])
    print("gaps: relabelled", gap(outs["llama"]), "unpermuted", gap(outs["unpermuted"]))
    assert gap(outs["unpermuted"]) > 1e-2
