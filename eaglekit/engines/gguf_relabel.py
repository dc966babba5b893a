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

from eaglekit.fileio import atomic_write

ROTATED = {"attn_q": "head_count", "attn_k": "head_count_kv"}


def neox_to_norm(rows, heads: int):
    """``rows`` (numpy, first axis = heads * head_dim output rows) reordered from halves to pairs per head."""
    d = rows.shape[0] // heads
    return rows.reshape(heads, 2, d // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def relabel_qwen2_as_llama(src, dst) -> Path:
    """Write the Qwen2 GGUF ``src`` as a llama GGUF ``dst`` (atomically); see the module docstring."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    src, dst = Path(src), Path(dst)
    reader = GGUFReader(str(src))
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field else None
    if arch != "qwen2":
        raise ValueError(f"{src}: general.architecture is {arch!r}; `eaglekit relabel` rewrites qwen2 GGUF files")
    heads = {k: int(reader.fields[f"qwen2.attention.{v}"].contents()) for k, v in ROTATED.items()}

    def write(tmp: str) -> None:
        writer = GGUFWriter(tmp, "llama", endianess=reader.endianess)
        for name, f in reader.fields.items():
            if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
                continue  # the writer writes these itself
            vtype = f.types[0]
            sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
            key = "llama." + name[len("qwen2."):] if name.startswith("qwen2.") else name
            writer.add_key_value(key, f.contents(), vtype, sub_type=sub)
        tensors = []
        for t in reader.tensors:
            data = t.data
            if (kind := t.name.split(".")[-2]) in ROTATED and t.name.startswith("blk."):
                data = neox_to_norm(data, heads[kind])
            tensors.append(data)
            writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for data in tensors:
            writer.write_tensor_data(data, tensor_endianess=reader.endianess)
        writer.close()

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
