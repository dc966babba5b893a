"""Feature sources for the trainer: ``FeatureDataset`` (offline shards) and ``OnlineFeatures`` (live target).

Both give ``len(ds)``, ``ds.lengths`` and ``ds[i]`` → ``{"input_ids": LongTensor[T], "loss_mask":
LongTensor[T], "hidden": bf16 [T, L*H] (eagle3 only), "last": bf16 [T, H]}``.

``FeatureDataset`` opens the shard that holds sample i with ``safe_open`` for each item and reads only
that sample's slices, then lets the file go: nothing of the data stays mapped between items, so memory
stays flat whatever the number of shards. Errors name the shard.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

import torch

from eaglekit.data_prep.capture import MANIFEST, compute_features, resolve_taps
from eaglekit.data_prep.vocab import VOCAB_FILE, load_draft_vocab
from eaglekit.target import EAGLE3


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

    def __len__(self) -> int:
        return len(self.lengths)

    def draft_vocab(self):
        """``(d2t, t2d)`` saved beside the shards (features_dir/draft_vocab.safetensors)."""
        return load_draft_vocab(self.dir / VOCAB_FILE)

    def locate(self, i: int) -> tuple[dict, int]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range ({len(self)} samples)")
        i %= len(self)
        j = bisect.bisect_right(self._firsts, i) - 1
        shard = self.manifest["shards"][j]
        return shard, i - shard["first_sample"]

    def __getitem__(self, i: int) -> dict:
        keys = (
            ("input_ids", "loss_mask", "hidden", "last")
            if self.kind == EAGLE3
            else ("input_ids", "loss_mask", "last")
        )
        return self._read(i, keys)

    def tokens(self, i: int) -> dict:
        """``input_ids`` and ``loss_mask`` of sample i only (e.g. to count a draft vocabulary from shards)."""
        return self._read(i, ("input_ids", "loss_mask"))

    def _read(self, i: int, keys) -> dict:
        from safetensors import safe_open

        shard, k = self.locate(i)
        path = self.dir / shard["file"]
        try:
            with safe_open(str(path), framework="pt") as f:
                lo, hi = (int(x) for x in f.get_slice("offsets")[k : k + 2])
                item = {key: f.get_slice(key)[lo:hi] for key in keys}
        except Exception as e:  # safetensors raises its own error types for bad headers / short files
            raise FeatureError(f"{path}: corrupt or truncated shard (reading sample {k}): {e}") from e
        if hi - lo != self.lengths[i]:
            raise FeatureError(f"{path}: sample {k} has {hi - lo} tokens, manifest says {self.lengths[i]}")
        for key in ("input_ids", "loss_mask"):
            item[key] = item[key].long()
        return item

    def verify(self) -> None:
        """Open every shard; check its shapes and its capture identity against the manifest (names the shard)."""
        from safetensors import safe_open

        width = len(self.layer_ids) * self.manifest["hidden_size"]
        for s in self.manifest["shards"]:
            path = self.dir / s["file"]
            try:
                with safe_open(str(path), framework="pt") as f:
                    shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
                    meta = json.loads((f.metadata() or {}).get("eaglekit", "{}"))
            except Exception as e:
                raise FeatureError(f"{path}: corrupt or truncated shard: {e}") from e
            want = {
                "input_ids": (s["num_tokens"],),
                "loss_mask": (s["num_tokens"],),
                "offsets": (s["num_samples"] + 1,),
                "last": (s["num_tokens"], self.manifest["hidden_size"]),
            }
            if self.kind == EAGLE3:
                want["hidden"] = (s["num_tokens"], width)
            if shapes != want:
                raise FeatureError(f"{path}: tensor shapes {shapes} do not match the manifest {want}")
            if meta.get("plan_hash") != self.manifest.get("plan_hash"):
                raise FeatureError(
                    f"{path}: written by another capture (plan {meta.get('plan_hash')}, "
                    f"manifest {self.manifest.get('plan_hash')})"
                )


class OnlineFeatures(torch.utils.data.Dataset):
    """The same items as ``FeatureDataset``, computed live from the frozen target (no disk).

    ``batch(indices)`` runs one padded forward for several samples (what a trainer should call);
    ``ds[i]`` is the one-sample form. Features are cast to ``dtype`` (bf16 by default, like the shards).
    """

    def __init__(
        self,
        target,
        samples: list[dict],
        kind: str = EAGLE3,
        layer_ids=None,
        dtype=torch.bfloat16,
        batch_tokens: int = 8192,
    ):
        self.target, self.samples, self.kind = target, samples, kind
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
        return compute_features(self.target, part, self.kind, self.layer_ids, self.batch_tokens, self.dtype)

    def __getitem__(self, i: int) -> dict:
        return self.batch([i])[0]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]
