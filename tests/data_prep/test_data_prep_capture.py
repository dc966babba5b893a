import json
import os

import pytest
import torch
from safetensors import safe_open

from eaglekit.data_prep import (
    FeatureDataset,
    FeatureError,
    OnlineFeatures,
    capture_features,
    tokenize_conversations,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest


def tiny_samples(tok, n=24):
    convs = [
        {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": "hello " * (i % 5 + 1)},
                {"role": "assistant", "content": "abc def " * (i % 4 + 1)},
            ],
        }
        for i in range(n)
    ]
    samples, empty = tokenize_conversations(tok, convs, max_length=64)
    assert not empty
    return samples


@pytest.fixture(scope="module")
def target():
    from helpers import tiny_target

    return tiny_target()


@pytest.fixture(scope="module")
def samples(target):
    return tiny_samples(target.tokenizer)


def test_shards_follow_the_design_layout(tmp_path, target, samples):
    m = capture_features(target, samples, tmp_path, shard_tokens=150, batch_tokens=96, progress=False)
    assert m["complete"] and len(m["shards"]) > 2
    assert m["layer_ids"] == list(target.default_taps) and m["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "manifest.json").read_text()) == m
    L, H = 3, target.hidden_size
    for s in m["shards"]:
        with safe_open(str(tmp_path / s["file"]), framework="pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        T = s["num_tokens"]
        assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == {
            "input_ids": (torch.int32, (T,)),
            "loss_mask": (torch.uint8, (T,)),
            "offsets": (torch.int64, (s["num_samples"] + 1,)),
            "taps": (torch.bfloat16, (T, L * H)),
            "last": (torch.bfloat16, (T, H)),
        }
        assert t["offsets"][0] == 0 and t["offsets"][-1] == T
        umask = os.umask(0)
        os.umask(umask)
        assert (tmp_path / s["file"]).stat().st_mode & 0o777 == 0o666 & ~umask  # not safetensors' 0600
    ds = FeatureDataset(tmp_path, target)
    ds.verify()
    assert len(ds) == len(samples) and ds.lengths == [len(s["input_ids"]) for s in samples]
    online = OnlineFeatures(target, samples)
    for i in (0, 7, len(samples) - 1):
        got, want = ds[i], online[i]
        assert torch.equal(got["input_ids"], samples[i]["input_ids"])
        assert torch.equal(got["loss_mask"], samples[i]["loss_mask"])
        assert {k: torch.equal(v, got[k]) for k, v in ds.tokens(i).items()} == {
            "input_ids": True,
            "loss_mask": True,
        }
        for k in ("taps", "last"):  # offline == online; and both equal an unbatched target forward
            assert torch.equal(got[k], want[k])
        ref = target.features(samples[i]["input_ids"][None])
        assert torch.allclose(got["taps"].float(), ref.taps[0].bfloat16().float(), atol=1e-2, rtol=1e-2)
        assert torch.allclose(got["last"].float(), ref.last[0].bfloat16().float(), atol=1e-2, rtol=1e-2)


def test_eagle1_capture_has_no_taps(tmp_path, target, samples):
    capture_features(target, samples[:5], tmp_path, kind="eagle1", progress=False)
    item = FeatureDataset(tmp_path)[2]
    assert set(item) == {"input_ids", "loss_mask", "last", "origin"}
    assert item["origin"] == f"{tmp_path / 'shard-00000.safetensors'} sample 2"


def test_resume_rewrites_only_missing_shards_and_refuses_other_data(tmp_path, target, samples):
    capture_features(target, samples, tmp_path, shard_tokens=150, progress=False)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("shard-*")}
    (tmp_path / "shard-00001.safetensors").unlink()
    (tmp_path / "shard-00001.safetensors.tmp-999").write_bytes(b"half a shard")  # a killed writer's leftover
    written = []
    capture_features(target, samples, tmp_path, shard_tokens=150, progress=False, on_shard=written.append)
    assert written == [1]
    assert {p.name: p.read_bytes() for p in tmp_path.glob("shard-*")} == before
    with pytest.raises(ValueError, match="different capture"):
        capture_features(target, samples[1:], tmp_path, shard_tokens=150, progress=False)


def test_ranks_split_shards_and_match_one_process(tmp_path, target, samples):
    capture_features(target, samples, tmp_path / "one", shard_tokens=150, progress=False)
    m0 = capture_features(
        target, samples, tmp_path / "two", shard_tokens=150, rank=0, world_size=2, progress=False
    )
    assert not m0["complete"]
    with pytest.raises(FeatureError, match="incomplete capture"):
        FeatureDataset(tmp_path / "two")
    m1 = capture_features(
        target, samples, tmp_path / "two", shard_tokens=150, rank=1, world_size=2, progress=False
    )
    assert m1["complete"]
    one = {p.name: p.read_bytes() for p in (tmp_path / "one").glob("shard-*")}
    two = {p.name: p.read_bytes() for p in (tmp_path / "two").glob("shard-*")}
    assert one == two and len(one) == len(m1["shards"])


def test_corrupt_truncated_and_foreign(tmp_path, target, samples):
    from helpers import tiny_target

    m = capture_features(target, samples, tmp_path, shard_tokens=150, progress=False)
    ds = FeatureDataset(tmp_path)
    shard = tmp_path / m["shards"][1]["file"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    i = m["shards"][1]["first_sample"]
    with pytest.raises(FeatureError, match=rf"{shard}: corrupt or truncated"):
        ds[i]
    with pytest.raises(FeatureError, match=rf"{shard}: corrupt or truncated"):
        ds.verify()
    assert torch.equal(ds[0]["input_ids"], samples[0]["input_ids"])  # other shards still read
    shard.write_bytes(b"\x00" * 7)
    with pytest.raises(FeatureError, match=str(shard)):
        ds[i]
    # a shard from another capture with the same shapes is caught by verify()
    foreign = capture_features(target, samples[::-1], tmp_path / "rev", shard_tokens=150, progress=False)
    assert foreign["shards"][0]["num_tokens"] == m["shards"][0]["num_tokens"]  # same shapes, other samples
    shard0 = tmp_path / m["shards"][0]["file"]
    shard0.write_bytes((tmp_path / "rev" / m["shards"][0]["file"]).read_bytes())
    shard.write_bytes(data)
    with pytest.raises(FeatureError, match=rf"{shard0}: written by another capture"):
        ds.verify()
    other = tiny_target(hidden=48)
    with pytest.raises(FeatureError, match="hidden_size 32 vs 48"):
        FeatureDataset(tmp_path, other)


def test_fp8_quantize_keeps_each_tap_within_e4m3_precision_of_its_own_scale():
    from eaglekit.data_prep.capture import dequantize, quantize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3 * 16, generator=g)
    x[0, :16] *= 1e4  # one token's first tap huge (an attention sink), its other taps untouched
    x[1] = 0.0
    q, scale = quantize(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 3)
    back = dequantize(q, scale, torch.float32)
    assert bool(torch.isfinite(back).all()) and torch.equal(back[1], x[1])
    err = (back - x).abs().view(6, 3, 16).amax(-1) / x.abs().view(6, 3, 16).amax(-1).clamp(min=1e-30)
    assert float(err.max()) <= 2**-4  # e4m3: 3 mantissa bits, the group's max maps to 448
    assert float(err.max()) > 2**-9  # and it is lossy (a bf16 store would be ~2^-8 at worst)
    assert float((back[0, 16:] - x[0, 16:]).abs().max()) < 0.5  # per-tap scale: the sink spares the others


def test_fp8_capture_reads_back_close_to_bf16_and_converting_writes_the_same_bytes(tmp_path, target, samples):
    from eaglekit.data_prep.capture import convert_features, file_sha256

    bf = capture_features(target, samples, tmp_path / "bf16", shard_tokens=150, progress=False)
    f8 = capture_features(target, samples, tmp_path / "fp8", shard_tokens=150, progress=False,
                          feature_dtype="float8_e4m3fn")
    L, H = 3, target.hidden_size
    assert f8["dtype"] == "float8_e4m3fn" and f8["bytes_per_token"] == (L + 1) * (H + 4) < bf["bytes_per_token"]
    assert f8["plan_hash"] != bf["plan_hash"]
    with safe_open(str(tmp_path / "fp8" / f8["shards"][0]["file"]), framework="pt") as f:
        assert f.get_slice("taps").get_dtype() == "F8_E4M3" and f.get_slice("taps_scale").get_shape()[1] == L
    a, b = FeatureDataset(tmp_path / "bf16", target), FeatureDataset(tmp_path / "fp8", target)
    b.verify()
    for i in (0, len(samples) - 1):
        x, y = a[i], b[i]
        assert y["taps"].dtype == torch.bfloat16 and torch.equal(x["input_ids"], y["input_ids"])
        for k in ("taps", "last"):
            scale = x[k].float().abs().amax()
            assert 0 < float((x[k].float() - y[k].float()).abs().max()) <= scale / 16 + 1e-2, k
    convert_features(tmp_path / "bf16", tmp_path / "converted")
    c = json.loads((tmp_path / "converted/manifest.json").read_text())
    assert c["plan_hash"] == f8["plan_hash"] and c["complete"]
    assert [file_sha256(tmp_path / "converted" / s["file"]) for s in c["shards"]] == [s["sha256"] for s in f8["shards"]]
    with pytest.raises(ValueError, match="bf16 capture"):
        convert_features(tmp_path / "fp8", tmp_path / "again")
