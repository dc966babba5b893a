"""``eaglekit relabel SRC.gguf DST.gguf``: a Qwen2 / Qwen2.5 GGUF rewritten as a ``llama`` GGUF, for users of a
stock llama-server.

llama.cpp's EAGLE-3 and DSpark drafts read the target's layer inputs, and a stock llama.cpp's qwen2 graph does
not record them (llama-server aborts: "layer input tensor is null"); its llama graph does. A Qwen2 layer is a
Llama layer with biases on q, k and v, which llama.cpp's llama graph loads when present, and a different rotary
layout: qwen2 rotates the two halves of each head (NEOX order), llama adjacent pairs (NORM order). So the file
is the same model under the llama architecture once

- ``general.architecture`` is ``llama`` and every ``qwen2.*`` key is renamed ``llama.*``;
- the rows of each attn_q / attn_k weight and bias are permuted from NEOX to NORM order within each head (the
  permutation llama.cpp's converter applies to Llama checkpoints), which turns the halves rotation into the
  pairs rotation of the same values: row ``h*d + 2i`` takes ``h*d + i``, row ``h*d + 2i + 1`` takes
  ``h*d + d/2 + i``. A quantised tensor is stored row by row (its blocks run along the input dimension), so
  rows move whole and their bytes are copied, never requantised.

eaglekit's own build (eaglekit.engines.llama_cpp) records Qwen2's layer inputs and needs none of this; tests check
that both files give the same greedy tokens in that build.
"""
from __future__ import annotations

from pathlib import Path

from eaglekit import assets
from eaglekit.fileio import atomic_write

ROTATED = {"attn_q": "head_count", "attn_k": "head_count_kv"}


def neox_to_norm(rows, heads: int):
    """``rows`` (numpy, first axis = heads * head_dim output rows) reordered from halves to pairs per head."""
    d = rows.shape[0] // heads
    return rows.reshape(heads, 2, d // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def relabel_qwen2_as_llama(src, dst) -> Path:
    """Write the Qwen2 GGUF ``src`` as a llama GGUF ``dst`` (atomically); see the module docstring. "qwen2" and
    "llama" have the same length, so the file keeps its layout byte for byte: a copy whose key names, architecture
    string and q/k rows are rewritten in place, each found from the header (``assets.gguf_layout``), never by
    parsing the vocabulary arrays."""
    import mmap
    import shutil

    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    src, dst = Path(src), Path(dst)
    layout = assets.gguf_layout(src)
    fields = layout["fields"]
    arch = fields.get("general.architecture", (0, 0, None))[2]
    if arch != "qwen2":
        raise ValueError(f"{src}: general.architecture is {arch!r}; `eaglekit relabel` rewrites qwen2 GGUF files")
    heads = {k: int(fields[f"qwen2.attention.{v}"][2]) for k, v in ROTATED.items()}

    def write(tmp: str) -> None:
        shutil.copyfile(src, tmp)
        with open(tmp, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            for key, (at, _, _) in fields.items():
                if key.startswith("qwen2."):  # the key's bytes follow its 8-byte length
                    m[at + 8:at + 8 + len("qwen2")] = b"llama"
            value_at = fields["general.architecture"][1]  # a string: its 8-byte length, then its bytes
            m[value_at + 8:value_at + 8 + len("qwen2")] = b"llama"
            for name, (dims, kind, offset) in layout["tensors"].items():
                if (part := name.split(".")[-2]) not in ROTATED or not name.startswith("blk."):
                    continue
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                rows = int(np.prod(dims[1:])) if len(dims) > 1 else dims[0]  # a bias: each element a row
                row_bytes = dims[0] // block * size if len(dims) > 1 else size
                view = np.frombuffer(m, np.uint8, rows * row_bytes, offset).reshape(rows, row_bytes)
                m[offset:offset + rows * row_bytes] = neox_to_norm(view, heads[part]).tobytes()
                del view  # an exported buffer keeps the map from closing

    return atomic_write(dst, write)


def add_arguments(p):
    p.description = ("SRC.gguf DST.gguf: write a Qwen2 / Qwen2.5 GGUF as a llama GGUF (same weights, rotary rows "
                     "reordered), so a stock llama-server can draft for it with an EAGLE-3 / DSpark head")


def run(args) -> int:
    words = args.overrides
    if len(words) != 2:
        raise SystemExit("usage: eaglekit relabel SRC.gguf DST.gguf")
    if Path(words[1]).exists():
        raise FileExistsError(f"{words[1]} exists; choose another name or remove it")
    print(relabel_qwen2_as_llama(*words))
    return 0
