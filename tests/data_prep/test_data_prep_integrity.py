"""Feature shards are checked: a sha256 per shard in the manifest (checked when a shard is first opened and
by ``verify()``), every feature read checked finite, and every item names where it came from."""
import json
import random
import struct
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_data_prep_capture import tiny_samples

from eaglekit.data_prep import FeatureDataset, FeatureError, OnlineFeatures, capture_features
from eaglekit.data_prep import capture as capture_mod
from eaglekit.data_prep.capture import file_sha256

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, see conftest


@pytest.fixture(scope="module")
def target():
    from helpers import tiny_target

    return tiny_target()


@pytest.fixture(scope="module")
def samples(target):
    return tiny_samples(target.tokenizer, n=12)


def capture(target, samples, out, **kw):
    return capture_features(target, samples, out, shard_tokens=100, progress=False, **kw)


def data_region(path) -> tuple[int, int]:
    """(start, end) of a safetensors file's tensor bytes: after the 8-byte length and the JSON header."""
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8 + n, path.stat().st_size


def test_manifest_records_each_shards_sha256_also_when_ranks_split_the_shards(tmp_path, target, samples):
    m = capture(target, samples, tmp_path / "one")
    assert len(m["shards"]) >= 3
    for s in m["shards"]:
        assert s["sha256"] == file_sha256(tmp_path / "one" / s["file"])
    assert json.loads((tmp_path / "one" / "manifest.json").read_text()) == m
    capture(target, samples, tmp_path / "two", rank=1, world_size=2)
    m2 = capture(target, samples, tmp_path / "two", rank=0, world_size=2)  # completes: gathers rank 1's sums
    assert m2["complete"] and [s["sha256"] for s in m2["shards"]] == [s["sha256"] for s in m["shards"]]


def test_random_bytes_in_a_shards_tensor_data_are_refused_naming_the_shard(tmp_path, target, samples):
    m = capture(target, samples, tmp_path)
    sh = m["shards"][1]
    path = tmp_path / sh["file"]
    start, end = data_region(path)
    raw = bytearray(path.read_bytes())
    rng = random.Random(0)
    at = rng.randrange(start, end - 64)
    raw[at : at + 64] = bytes(rng.randrange(256) for _ in range(64))
    path.write_bytes(bytes(raw))
    with safe_open(str(path), framework="pt") as f:  # the header is intact: safetensors reads it happily
        assert set(f.keys()) == {"input_ids", "loss_mask", "offsets", "taps", "last"}
    ds = FeatureDataset(tmp_path)
    assert torch.equal(ds[0]["input_ids"], samples[0]["input_ids"])  # other shards still read
    with pytest.raises(FeatureError, match=rf"^{path}: corrupt or truncated shard: its sha256"):
        ds[sh["first_sample"] + sh["num_samples"] - 1]
    with pytest.raises(FeatureError, match=rf"^{path}: corrupt"):
        ds.tokens(sh["first_sample"])  # what counting a vocabulary from the shards reads
    with pytest.raises(FeatureError, match=rf"^{path}: corrupt or truncated shard"):
        FeatureDataset(tmp_path).verify()


def test_a_shard_is_hashed_once_per_dataset(tmp_path, target, samples, monkeypatch):
    m = capture(target, samples, tmp_path)
    ds = FeatureDataset(tmp_path)
    hashed = []
    monkeypatch.setattr("eaglekit.data_prep.dataset.file_sha256", lambda p: hashed.append(p) or file_sha256(p))
    sh = m["shards"][0]
    for i in range(sh["num_samples"]):
        ds[i]
    ds[sh["num_samples"]]  # the next shard
    assert hashed == [tmp_path / sh["file"], tmp_path / m["shards"][1]["file"]]


def plant(path, key: str, row: int, value: float) -> None:
    """Set one feature row of a shard to ``value`` (re-saved with its metadata)."""
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        meta = f.metadata()
    tensors[key][row, 3] = value
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize(("key", "value"), [("last", float("nan")), ("taps", float("inf"))])
def test_a_non_finite_feature_with_a_matching_checksum_names_shard_and_sample(tmp_path, target, samples, key, value):
    m = capture(target, samples, tmp_path)
    j, k = 2, 1  # sample 1 of shard 2
    sh = m["shards"][j]
    path = tmp_path / sh["file"]
    row = int(torch.tensor(m["lengths"][sh["first_sample"] : sh["first_sample"] + k]).sum()) + 2
    plant(path, key, row, value)
    m["shards"][j]["sha256"] = file_sha256(path)  # the checksum agrees: only the finite check can see it
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    ds = FeatureDataset(tmp_path)
    for i in range(sh["first_sample"], sh["first_sample"] + sh["num_samples"]):
        if i != sh["first_sample"] + k:
            ds[i]  # the other samples of the shard are fine
    with pytest.raises(FeatureError, match=rf"^{path}: sample {k} has non-finite values \(NaN/Inf\) in '{key}'"):
        ds[sh["first_sample"] + k]
    with pytest.raises(FeatureError, match=rf"^{path}: sample {k} has non-finite values \(NaN/Inf\) in '{key}'"):
        ds.verify()


def test_verify_scans_features_in_pieces(tmp_path, target, samples, monkeypatch):
    m = capture(target, samples, tmp_path)
    sh = m["shards"][0]
    path = tmp_path / sh["file"]
    last_row = sh["num_tokens"] - 1
    plant(path, "last", last_row, float("nan"))
    m["shards"][0]["sha256"] = file_sha256(path)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    monkeypatch.setattr("eaglekit.data_prep.dataset.SCAN_BYTES", 3 * 2 * target.hidden_size)  # 3 rows a piece
    with pytest.raises(FeatureError, match=rf"^{path}: sample {sh['num_samples'] - 1} has non-finite"):
        FeatureDataset(tmp_path).verify()


def test_a_manifest_without_checksums_is_read_with_a_warning(tmp_path, target, samples):
    m = capture(target, samples, tmp_path)
    for s in m["shards"]:
        del s["sha256"]
    (tmp_path / "manifest.json").write_text(json.dumps({**m, "format_version": 1}))
    with pytest.warns(UserWarning, match="records no shard checksums.*unchecked"):
        ds = FeatureDataset(tmp_path)
    ds.verify()
    assert torch.equal(ds[3]["input_ids"], samples[3]["input_ids"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture(target, samples, tmp_path / "new")
        FeatureDataset(tmp_path / "new")  # a checked capture: no warning


def test_resume_removes_a_killed_writers_temp_and_records_the_sum(tmp_path, target, samples):
    m = capture(target, samples, tmp_path)
    (tmp_path / "shard-00001.safetensors").unlink()
    (tmp_path / "checksums" / "shard-00001.safetensors.sha256").unlink()
    stale = tmp_path / ".shard-00001.safetensors.x1y2.tmp"  # fileio's temp name, left by kill -9
    stale.write_bytes(b"half")
    again = capture(target, samples, tmp_path)
    assert not stale.exists() and again["shards"] == m["shards"]


def test_a_shard_from_an_older_capture_without_a_sum_file_gets_one_at_completion(tmp_path, target, samples, caplog):
    m = capture(target, samples, tmp_path, rank=0, world_size=2)
    assert not m["complete"]
    for p in (tmp_path / "checksums").iterdir():  # as an eaglekit without checksums would have left it
        p.unlink()
    done = capture(target, samples, tmp_path, rank=1, world_size=2)
    assert done["complete"] and all(s["sha256"] == file_sha256(tmp_path / s["file"]) for s in done["shards"])
    assert "no recorded checksum" in caplog.text


def test_items_name_their_origin(tmp_path, target, samples):
    m = capture(target, samples, tmp_path)
    ds = FeatureDataset(tmp_path)
    sh = m["shards"][1]
    assert ds[sh["first_sample"] + 2]["origin"] == f"{tmp_path / sh['file']} sample 2"
    online = OnlineFeatures(target, samples, where="data/conv.jsonl")
    got = online.batch([4, 1])
    assert [it["origin"] for it in got] == ["data/conv.jsonl item 4 (id c4)", "data/conv.jsonl item 1 (id c1)"]
    assert "origin" not in ds.tokens(0)


def test_stale_temp_pattern():
    names = ["shard-00001.safetensors.tmp-99", ".shard-00002.safetensors.ab_c.tmp", "shard-00003.safetensors"]
    assert [bool(capture_mod._STALE.match(n)) for n in names] == [True, True, False]


def test_shards_of_an_older_capture_name_the_taps_hidden_and_still_read(tmp_path, target, samples):
    """Before capture format 3 the taps tensor was stored as ``hidden``: read (and verified) as ``taps``."""
    m = capture(target, samples, tmp_path)
    want = [FeatureDataset(tmp_path)[i] for i in range(len(samples))]
    for sh in m["shards"]:
        path = tmp_path / sh["file"]
        with safe_open(str(path), framework="pt") as f:
            tensors = {("hidden" if k == "taps" else k): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            meta = f.metadata()
        save_file(tensors, str(path), metadata=meta)
        sh["sha256"] = file_sha256(path)
    (tmp_path / "manifest.json").write_text(json.dumps({**m, "format_version": 2}))
    ds = FeatureDataset(tmp_path)
    ds.verify()
    for i, item in enumerate(want):
        got = ds[i]
        assert set(got) == set(item) and "taps" in got
        assert all(torch.equal(got[k], item[k]) for k in item if k != "origin")
    plant(tmp_path / m["shards"][0]["file"], "hidden", 0, float("nan"))
    m["shards"][0]["sha256"] = file_sha256(tmp_path / m["shards"][0]["file"])
    (tmp_path / "manifest.json").write_text(json.dumps({**m, "format_version": 2}))
    with pytest.raises(FeatureError, match="sample 0 has non-finite values \\(NaN/Inf\\) in 'taps'"):
        FeatureDataset(tmp_path).verify()
