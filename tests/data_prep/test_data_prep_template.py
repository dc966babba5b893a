import logging

import pytest
import torch

from eaglekit.data_prep import build_draft_vocab, load_draft_vocab, save_draft_vocab, tokenize_conversation
from eaglekit.data_prep.template import TemplateError

CONV = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello there"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "a2, ok"},
]

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def masked_runs(tok, sample):
    """Decoded text of each contiguous run of mask=1 tokens."""
    ids, mask = sample["input_ids"].tolist(), sample["loss_mask"].tolist()
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [_decode(tok, r) for r in runs]


def _decode(tok, ids):
    if tok.backend_tokenizer.model.__class__.__name__ == "WordLevel":  # char-level test tokenizers
        return "".join(tok.convert_ids_to_tokens(list(ids)))
    return tok.decode(ids)


def llama3_tokenizer():
    """A tiny char-level tokenizer carrying a Llama-3-style chat template and its special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 .,!?\n")
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(special + chars)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.add_special_tokens(special)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    fast.chat_template = LLAMA3
    return fast


def test_tiny_template_exact_mask():
    from helpers import tiny_tokenizer

    tok = tiny_tokenizer()
    s = tokenize_conversation(tok, CONV)
    assert s["input_ids"].dtype == torch.long and s["loss_mask"].shape == s["input_ids"].shape
    assert masked_runs(tok, s) == ["hello there<end>", "a2, ok<end>"]


def test_llama3_style_template_exact_mask():
    tok = llama3_tokenizer()
    conv = [{"role": "system", "content": "be nice"}] + CONV
    conv[2] = {**conv[2], "content": "  hello there \n"}  # the template trims content
    s = tokenize_conversation(tok, conv)
    text = _decode(tok, s["input_ids"].tolist())
    assert text == tok.apply_chat_template(conv, tokenize=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe nice<|eot_id|>")
    assert masked_runs(tok, s) == ["hello there<|eot_id|>", "a2, ok<|eot_id|>"]


def test_truncation_and_all_zero_mask_reported(caplog):
    from helpers import tiny_tokenizer

    tok = tiny_tokenizer()
    full = tokenize_conversation(tok, CONV)
    cut = tokenize_conversation(tok, CONV, max_length=10)
    assert torch.equal(cut["input_ids"], full["input_ids"][:10])
    assert torch.equal(cut["loss_mask"], full["loss_mask"][:10])
    with caplog.at_level(logging.WARNING):
        zero = tokenize_conversation(tok, CONV, max_length=4, where="conv7: ")
    assert not zero["loss_mask"].any()
    assert "conv7: loss mask is all zero" in caplog.text


def test_template_that_rewrites_history_is_refused():
    from helpers import tiny_tokenizer

    tok = tiny_tokenizer()
    # renders only the last assistant turn in full: prefixes are not prefixes of the whole
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{% if loop.last or m['role'] != 'assistant' %}"
        "{{ m['content'] }}{% endif %}<end>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    with pytest.raises(TemplateError, match="turn 1"):
        tokenize_conversation(tok, CONV)


def _real_tokenizer(name):
    from transformers import AutoTokenizer

    from eaglekit import assets

    return AutoTokenizer.from_pretrained(assets.model_dir(name))


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_real_chatml_templates_exact_mask(name):
    tok = _real_tokenizer(name)
    conv = CONV[:2] + [
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "line1\nline2 <|im_end|> x"},
    ]
    s = tokenize_conversation(tok, conv)
    # the content's own literal "<|im_end|>" stays in the answer; the newline after the real one is template
    assert masked_runs(tok, s) == ["hello there<|im_end|>", "line1\nline2 <|im_end|> x<|im_end|>"]
    text = tok.decode(s["input_ids"])
    assert text == tok.apply_chat_template(conv, tokenize=False)
    assert s["input_ids"].tolist() == tok.apply_chat_template(conv, return_dict=True)["input_ids"]
    unmasked = tok.decode(s["input_ids"][s["loss_mask"] == 0])
    assert unmasked == text.replace("hello there<|im_end|>", "").replace(
        conv[3]["content"] + "<|im_end|>", ""
    )


def test_vocab_round_trip_and_frequency(tmp_path):
    V, Vd = 64, 10
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(30):
        ids = torch.randint(0, V, (40,), generator=g)
        samples.append({"input_ids": ids, "loss_mask": (torch.rand(40, generator=g) < 0.5).long()})
    d2t, t2d = build_draft_vocab(samples, Vd, V)
    assert d2t.dtype == torch.int64 and d2t.shape == (Vd,) and t2d.dtype == torch.bool and t2d.shape == (V,)
    ids = torch.arange(Vd) + d2t
    assert bool(t2d[ids].all()) and int(t2d.sum()) == Vd  # t2d[i + d2t[i]] for every draft id
    counts = torch.zeros(V, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s["input_ids"][s["loss_mask"] == 1], minlength=V)
    assert counts[t2d].min() >= counts[~t2d].max()  # the most frequent masked tokens were chosen
    path = save_draft_vocab(tmp_path / "feats", d2t, t2d)
    assert path == tmp_path / "feats" / "draft_vocab.safetensors"
    d2t2, t2d2 = load_draft_vocab(tmp_path / "feats")
    assert torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2)
    save_draft_vocab(tmp_path / "bad.safetensors", d2t + 1, t2d)
    with pytest.raises(ValueError, match="disagree"):
        load_draft_vocab(tmp_path / "bad.safetensors")


def test_vocab_fills_unseen_ids_when_data_is_small():
    s = [{"input_ids": torch.tensor([5, 5, 9, 3]), "loss_mask": torch.tensor([1, 1, 1, 0])}]
    d2t, _ = build_draft_vocab(s, 4, 16)
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 5, 9]  # 5, 9 seen; 0, 1 lowest unseen; 3 unmasked


def test_huge_turn_is_cut_before_tokenizing(monkeypatch):
    """A 4 MB answer: only max_length * CHARS_PER_TOKEN characters reach the tokenizer, same sample."""
    from helpers import tiny_tokenizer

    from eaglekit.data_prep.template import CHARS_PER_TOKEN

    tok = tiny_tokenizer()
    seen = []
    call = type(tok).__call__
    monkeypatch.setattr(type(tok), "__call__", lambda self, text, **kw: seen.append(len(text)) or call(self, text, **kw))
    conv = CONV[:1] + [{"role": "assistant", "content": "ab " * 1_400_000}] + CONV[2:]
    max_length = 50
    cut = tokenize_conversation(tok, conv, max_length=max_length)
    assert max(seen) <= max_length * CHARS_PER_TOKEN + 100  # + the template's own text
    full = tokenize_conversation(tok, conv[:1] + [{"role": "assistant", "content": "ab " * 100}])
    assert torch.equal(cut["input_ids"], full["input_ids"][:max_length])
    assert torch.equal(cut["loss_mask"], full["loss_mask"][:max_length])
    seen.clear()  # a normal conversation is tokenized whole, as before
    assert torch.equal(tokenize_conversation(tok, CONV, max_length=max_length)["input_ids"],
                       tokenize_conversation(tok, CONV)["input_ids"])


def test_template_that_drops_assistant_content_is_refused():
    from helpers import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = (  # prefixes are prefixes, but an assistant turn renders as "<assistant><end>"
        "{% for m in messages %}<{{ m['role'] }}>{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}"
        "<end>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    with pytest.raises(TemplateError, match="does not render the content of assistant turn 1"):
        tokenize_conversation(tok, CONV)
