"""Feature sources for the trainer: ``FeatureDataset`` (offline shards) and ``OnlineFeatures`` (live target).

Both give ``len(ds)``, ``ds.lengths`` and ``ds[i]`` → ``{"input_ids": LongTensor[T], "loss_mask":
LongTensor[T], "taps": bf16 [T, L*H] (eagle3 only), "last": bf16 [T, H]}``. Shards written before
capture format 3 store the taps as ``hidden``; they are read under the one name ``taps``. Shards stored in
fp8 (``feature_dtype="float8_e4m3fn"``) are read back in bf16 through their scales.

``FeatureDataset`` opens the shard that holds sample i with ``safe_open`` for each item and reads only
that sample's slices, then lets the file go: nothing of the data stays mapped between items, so memory
stays flat whatever the number of shards. Errors name the shard.

Integrity: the first time a ``FeatureDataset`` opens a shard it checks the file's sha256 against the
manifest (one streamed read of the shard per process); every item read is checked finite. Each item
carries ``"origin"``, where it came from (``"<features_dir>/shard-00003.safetensors sample 17"``, or
``"<conversations> item 12 (id c12)"`` online), so a trainer can name the samples of a bad batch.
"""

from __future__ import annotations

import bisect
import json
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from eaglekit.data_prep.capture import FP8, MANIFEST, compute_features, dequantize, file_sha256, resolve_taps
from eaglekit.data_prep.vocab import VOCAB_FILE, load_draft_vocab, vocab_hash
from eaglekit.heads import EAGLE3

TAPS, OLD_TAPS = "taps", "hidden"  # the taps tensor's name in shards (before capture format 3: "hidden")
FEATURE_KEYS = (TAPS, "last")  # the float tensors, checked finite
SCAN_BYTES = 64 * 2**20  # verify() reads features in pieces of this size


class FeatureError(ValueError):
    """A feature directory that is incomplete, corrupt, or made for another target."""


def check_manifest(manifest: dict, target, where: str = "") -> None:
    """Refuse features captured from another target (fingerprint / hidden size), naming what differs."""
    tgt = manifest["target"]
    diffs = []
    if tgt["hidden_size"] != target.hidden_size:
        diffs.append(f"hidden_size {tgt['hidden_size']} vs {target.hidden_size}")
    if tgt["vocab_size"] != target.vocab_size:
        diffs.append(f"vocab_size {tgt['vocab_size']} vs {target.vocab_size}")
    if tgt["fingerprint"] != target.fingerprint():
        diffs.append(
            f"fingerprint {tgt['fingerprint']} vs {target.fingerprint()} (architecture or tokenizer)"
        )
    if diffs:
        raise FeatureError(
            f"{where}features were captured from {tgt['name']!r}, not this target "
            f"{target.name!r}: " + "; ".join(diffs)
        )


class FeatureDataset(torch.utils.data.Dataset):
    """Lazy reader of a capture directory (see ``capture.py``)."""

    def __init__(self, features_dir: str | Path, target=None):
        self.dir = Path(features_dir)
        path = self.dir / MANIFEST
        if not path.exists():
            raise FeatureError(f"{self.dir}: no {MANIFEST} (not a feature directory)")
        try:
            self.manifest = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise FeatureError(f"{path}: corrupt manifest ({e})") from e
        shards = self.manifest["shards"]
        missing = [s["file"] for s in shards if not (self.dir / s["file"]).exists()]
        if missing or not self.manifest.get("complete"):
            raise FeatureError(
                f"{self.dir}: incomplete capture, {len(missing)} of {len(shards)} shard(s) missing "
                f"(first: {missing[0] if missing else '-'}); rerun the capture to resume"
            )
        if target is not None:
            check_manifest(self.manifest, target, f"{self.dir}: ")
        self.lengths: list[int] = list(self.manifest["lengths"])
        self.kind = self.manifest["kind"]
        self.layer_ids = tuple(self.manifest["layer_ids"])
        self._firsts = [s["first_sample"] for s in shards]
        self._checked: set[str] = set()  # shards whose checksum this process has already checked
        if any("sha256" not in s for s in shards):
            warnings.warn(
                f"{path} records no shard checksums (captured by an older eaglekit): the shards are read "
                "unchecked (every feature is still checked finite); recapture to have them checked",
                stacklevel=2,
            )

    def __len__(self) -> int:
        return len(self.lengths)

    def draft_vocab(self):
        """``(d2t, t2d)`` saved beside the shards (features_dir/draft_vocab.safetensors), refused if the
        manifest records another vocabulary."""
        path = self.dir / VOCAB_FILE
        d2t, t2d = load_draft_vocab(path)
        problem = self.vocab_mismatch(d2t, t2d, path)
        if problem:
            raise FeatureError(problem)
        return d2t, t2d

    def vocab_mismatch(self, d2t, t2d, path) -> str | None:
        """A message naming both files if the manifest records a draft vocabulary other than
        ``(d2t, t2d)`` (read from ``path``); None if it is the recorded one or none is recorded."""
        want = (self.manifest.get("draft_vocab") or {}).get("sha256")
        if want is None:
            return None
        got = vocab_hash(d2t, t2d)
        if got == want:
            return None
        return (
            f"{path}: draft vocabulary (sha256 {got[:12]}, {d2t.numel()} tokens) is not the one "
            f"{self.dir / MANIFEST} records for these shards (sha256 {want[:12]}, "
            f"{self.manifest['draft_vocab'].get('size')} tokens): it belongs to another capture; rerun "
            "prepare into this directory to rebuild it, or give the vocabulary that belongs to the shards"
        )

    def locate(self, i: int) -> tuple[dict, int]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range ({len(self)} samples)")
        i %= len(self)
        j = bisect.bisect_right(self._firsts, i) - 1
        shard = self.manifest["shards"][j]
        return shard, i - shard["first_sample"]

    def __getitem__(self, i: int) -> dict:
        keys = ("input_ids", "loss_mask", TAPS, "last") if self.layer_ids else ("input_ids", "loss_mask", "last")
        return {**self._read(i, keys), "origin": self.origin(i)}

    def tokens(self, i: int) -> dict:
        """``input_ids`` and ``loss_mask`` of sample i only (e.g. to count a draft vocabulary from shards)."""
        return self._read(i, ("input_ids", "loss_mask"))

    def _read(self, i: int, keys) -> dict:
        shard, k = self.locate(i)
        path = self.dir / shard["file"]
        if shard["file"] not in self._checked:
            self.check_shard(shard)
        try:
            with safe_open(str(path), framework="pt") as f:
                lo, hi = (int(x) for x in f.get_slice("offsets")[k : k + 2])
                item = {key: read_rows(f, key, lo, hi) for key in keys}
        except Exception as e:  # safetensors raises its own error types for bad headers / short files
            raise FeatureError(f"{path}: corrupt or truncated shard (reading sample {k}): {e}") from e
        if hi - lo != self.lengths[i]:
            raise FeatureError(f"{path}: sample {k} has {hi - lo} tokens, manifest says {self.lengths[i]}")
        for key in FEATURE_KEYS:
            if key in item and not bool(torch.isfinite(item[key]).all()):
                raise FeatureError(f"{path}: sample {k} has non-finite values (NaN/Inf) in {key!r}: corrupt shard")
        for key in ("input_ids", "loss_mask"):
            item[key] = item[key].long()
        return item

    def origin(self, i: int) -> str:
        """Where sample ``i`` lives: ``"<features_dir>/shard-00003.safetensors sample 17"``."""
        shard, k = self.locate(i)
        return f"{self.dir / shard['file']} sample {k}"

    def check_shard(self, shard: dict) -> None:
        """Refuse a shard whose bytes do not have the sha256 the manifest records (no-op without one)."""
        path = self.dir / shard["file"]
        want = shard.get("sha256")
        if want is not None:
            try:
                got = file_sha256(path)
            except OSError as e:
                raise FeatureError(f"{path}: cannot read shard: {e}") from e
            if got != want:
                raise FeatureError(
                    f"{path}: corrupt or truncated shard: its sha256 {got[:12]} is not {want[:12]}, recorded in "
                    f"{self.dir / MANIFEST} when it was written; delete it and rerun the capture to rewrite it"
                )
        self._checked.add(shard["file"])

    def verify(self) -> None:
        """Check every shard: checksum, shapes, capture identity against the manifest, and every feature
        finite (names the shard, and the sample of a non-finite value)."""
        width = len(self.layer_ids) * self.manifest["hidden_size"]
        for s in self.manifest["shards"]:
            path = self.dir / s["file"]
            try:
                with safe_open(str(path), framework="pt") as f:
                    shapes = {TAPS if k == OLD_TAPS else k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
                    meta = json.loads((f.metadata() or {}).get("eaglekit", "{}"))
            except Exception as e:
                raise FeatureError(f"{path}: corrupt or truncated shard: {e}") from e
            want = {
                "input_ids": (s["num_tokens"],),
                "loss_mask": (s["num_tokens"],),
                "offsets": (s["num_samples"] + 1,),
                "last": (s["num_tokens"], self.manifest["hidden_size"]),
            }
            if self.layer_ids:
                want[TAPS] = (s["num_tokens"], width)
            if self.manifest.get("dtype") == FP8:
                want["last_scale"] = (s["num_tokens"], 1)
                if self.layer_ids:
                    want["taps_scale"] = (s["num_tokens"], len(self.layer_ids))
            if shapes != want:
                raise FeatureError(f"{path}: tensor shapes {shapes} do not match the manifest {want}")
            if meta.get("plan_hash") != self.manifest.get("plan_hash"):
                raise FeatureError(
                    f"{path}: written by another capture (plan {meta.get('plan_hash')}, "
                    f"manifest {self.manifest.get('plan_hash')})"
                )
            self.check_shard(s)  # after the header checks, which name a foreign shard more precisely
            self._scan_finite(path)

    def _scan_finite(self, path: Path) -> None:
        """Read each feature tensor of a shard in ~SCAN_BYTES pieces; name the first non-finite sample."""
        with safe_open(str(path), framework="pt") as f:
            offsets = f.get_tensor("offsets")
            for key in (k for k in FEATURE_KEYS if stored_name(f, k) in f.keys()):  # noqa: SIM118 (safe_open is not a dict)
                rows = f.get_slice(stored_name(f, key))
                total, width = rows.get_shape()
                step = max(1, SCAN_BYTES // (2 * max(1, width)))
                for lo in range(0, total, step):
                    bad = (~torch.isfinite(read_rows(f, key, lo, lo + step))).any(dim=-1).nonzero()
                    if bad.numel():
                        row = lo + int(bad[0])
                        k = int(torch.searchsorted(offsets, row, right=True)) - 1
                        raise FeatureError(
                            f"{path}: sample {k} has non-finite values (NaN/Inf) in {key!r}: corrupt shard"
                        )


def read_rows(shard, key: str, lo: int, hi: int) -> torch.Tensor:
    """Rows ``lo:hi`` of tensor ``key`` of an open shard; fp8 features dequantized to bf16 with their scales."""
    rows = shard.get_slice(stored_name(shard, key))[lo:hi]
    if f"{key}_scale" in shard.keys():  # noqa: SIM118 (safe_open is not a dict)
        return dequantize(rows, shard.get_slice(f"{key}_scale")[lo:hi])
    return rows


def stored_name(shard, key: str) -> str:
    """The name ``key`` has in an open shard: ``taps`` is ``hidden`` in shards of capture format < 3."""
    return OLD_TAPS if key == TAPS and TAPS not in shard.keys() else key  # noqa: SIM118 (safe_open is not a dict)


class OnlineFeatures(torch.utils.data.Dataset):
    """The same items as ``FeatureDataset``, computed live from the frozen target (no disk).

    ``batch(indices)`` runs one padded forward for several samples (what a trainer should call);
    ``ds[i]`` is the one-sample form. Features are cast to ``dtype`` (bf16 by default, like the shards).
    ``where`` names the data in each item's ``origin`` (``"<where> item 12 (id c12)"``).
    """

    def __init__(
        self,
        target,
        samples: list[dict],
        kind: str = EAGLE3,
        layer_ids=None,
        dtype=torch.bfloat16,
        batch_tokens: int = 8192,
        where: str = "online",
    ):
        self.target, self.samples, self.kind, self.where = target, samples, kind, where
        self.layer_ids = resolve_taps(target, kind, layer_ids)
        self.dtype, self.batch_tokens = dtype, batch_tokens
        self.lengths = [len(s["input_ids"]) for s in samples]
        self.manifest = {
            "kind": kind,
            "layer_ids": list(self.layer_ids),
            "hidden_size": target.hidden_size,
            "num_samples": len(samples),
            "num_tokens": sum(self.lengths),
        }

    def __len__(self) -> int:
        return len(self.samples)

    def batch(self, indices) -> list[dict]:
        part = [self.samples[i] for i in indices]
        items = compute_features(self.target, part, self.kind, self.layer_ids, self.batch_tokens, self.dtype)
        return [{**it, "origin": self.origin(i)} for i, it in zip(indices, items)]

    def origin(self, i: int) -> str:
        sid = self.samples[i].get("id")
        return f"{self.where} item {i}" + (f" (id {sid})" if sid is not None else "")

    def __getitem__(self, i: int) -> dict:
        return self.batch([i])[0]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]
