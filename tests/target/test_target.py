import pytest
import torch
from helpers import save_tiny, tiny_target

from eaglekit.target import default_taps, load_target


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_eagle3_taps_equal_output_hidden_states(arch):
    t = tiny_target(arch, layers=8)
    ids = torch.randint(0, 64, (2, 11))
    feats = t.features(ids)
    ref = t.model(ids, output_hidden_states=True).hidden_states
    H = t.hidden_size
    assert t.default_taps == (2, 4, 5)
    assert feats.taps.shape == (2, 11, 3 * H)
    for k, layer in enumerate(t.default_taps):
        torch.testing.assert_close(feats.taps[..., k * H:(k + 1) * H], ref[layer], rtol=0, atol=0)
    torch.testing.assert_close(feats.last, ref[-1], rtol=0, atol=0)


def test_custom_layer_ids_and_no_taps():
    t = tiny_target("llama", layers=6)
    ids = torch.randint(0, 64, (1, 7))
    ref = t.model(ids, output_hidden_states=True).hidden_states
    f = t.features(ids, layer_ids=(0, 5))
    torch.testing.assert_close(f.taps, torch.cat([ref[0], ref[5]], -1), rtol=0, atol=0)
    f1 = t.features(ids, layer_ids=())  # a head without taps (EAGLE-1's head.taps) taps none
    assert f1.taps is None
    torch.testing.assert_close(f1.last, ref[-1], rtol=0, atol=0)


def test_default_taps():
    assert default_taps(30) == (2, 15, 27)
    assert default_taps(24) == (2, 12, 21)
    t = tiny_target("llama", layers=6)
    out = t.forward(torch.randint(0, 64, (1, 5)))
    assert t.default_taps == (2, 3, 3) and out.taps.shape[-1] == 3 * t.hidden_size  # layer_ids=None: the defaults
    with pytest.raises(TypeError, match="kind"):  # the taps are asked for by layer_ids only
        t.forward(torch.randint(0, 64, (1, 5)), kind=None)


def test_lora_changes_taps_and_merge_equals_live(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = save_tiny(tmp_path / "base", "llama")
    t = load_target(base)
    peft = get_peft_model(t.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft.save_pretrained(tmp_path / "lora")
    ids = torch.randint(0, 64, (1, 9))
    plain = load_target(base).features(ids)
    live = load_target(base, adapter=tmp_path / "lora").features(ids)
    merged = load_target(base, adapter=tmp_path / "lora", merge_adapter=True).features(ids)
    assert (live.taps - plain.taps).abs().max() > 1e-3, "the adapter must change the taps"
    torch.testing.assert_close(merged.taps, live.taps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged.last, live.last, rtol=1e-5, atol=1e-5)


def test_forward_logits_match_model_with_cache():
    from transformers import DynamicCache

    t = tiny_target("qwen2")
    ids = torch.randint(0, 64, (1, 10))
    full = t.model(ids).logits
    cache = DynamicCache()
    a = t.forward(ids[:, :6], past_key_values=cache)
    b = t.forward(ids[:, 6:], past_key_values=a.past_key_values)
    torch.testing.assert_close(torch.cat([a.logits, b.logits], 1), full, rtol=1e-5, atol=1e-5)


def test_load_target_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_target(tmp_path)
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_target(tmp_path / "missing.gguf")


@pytest.mark.real
def test_lm_head_of_last_reproduces_logits_smollm2(smollm2):
    t = smollm2
    assert (t.num_layers, t.hidden_size, t.vocab_size) == (30, 576, 49152)
    msgs = [{"role": "user", "content": "Write a haiku about the sea."}]
    ids = t.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)["input_ids"]
    out = t.forward(ids)
    ref = t.model(ids, output_hidden_states=True)
    torch.testing.assert_close(t.lm_head(out.last), ref.logits, rtol=1e-6, atol=1e-5)
    for k, layer in enumerate(t.default_taps):
        torch.testing.assert_close(out.taps[..., k * 576:(k + 1) * 576], ref.hidden_states[layer], rtol=0, atol=0)


@pytest.mark.real
def test_real_qwen2_taps(qwen05):
    t = qwen05
    assert (t.num_layers, t.hidden_size, t.vocab_size) == (24, 896, 151936)
    ids = t.tokenizer("def fibonacci(n):", return_tensors="pt")["input_ids"]
    out = t.forward(ids)
    ref = t.model(ids, output_hidden_states=True)
    torch.testing.assert_close(t.lm_head(out.last), ref.logits, rtol=1e-6, atol=1e-4)
    for k, layer in enumerate(t.default_taps):
        torch.testing.assert_close(out.taps[..., k * 896:(k + 1) * 896], ref.hidden_states[layer], rtol=0, atol=0)


def test_chat_ids_uses_the_tokenizers_template():
    t = tiny_target("llama")
    msgs = [{"role": "user", "content": "hi"}]
    want = t.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert t.chat_ids("hi").tolist() == [want]
    assert t.chat_ids(msgs).tolist() == [want]


def test_fingerprint_follows_the_vocabulary_and_shape():
    """Memoised, but a token added to the tokenizer or a changed shape gives a new fingerprint."""
    t = tiny_target()
    first = t.fingerprint()
    assert t.fingerprint() == first == tiny_target(seed=3).fingerprint()  # weights do not enter it
    t.tokenizer.add_tokens(["<new-token>"])
    added = t.fingerprint()
    assert added != first
    t.config.intermediate_size += 8
    assert t.fingerprint() not in (first, added)
