"""KV keep: after verification, move each row's accepted path into contiguous slots and truncate; a row's
slice of the target's output (``row_output``), what its drafter reads.

The target's cache is a transformers ``DynamicCache``. Its per-layer tensors are reached through the
public attributes that exist on the installed version: ``cache.layers[i].keys/.values`` (transformers
>= 4.56, including 5.17 and 5.24) or ``cache.key_cache[i]/.value_cache[i]`` (older). ``new_cache`` keeps every
entry of every layer, sliding-window ones included; a sliding-window cache layer that has already dropped
tokens (one built elsewhere) cannot be rolled back, so it is refused. Keys and values may differ in width
(DeepSeek-V3's MLA caches its compressed latent as keys and its rotary part as values). The head keeps its
own ``HeadCache`` (``crop``/``keep``), handled by the drafter.
"""
from __future__ import annotations

from dataclasses import fields, replace

import torch
from transformers import DynamicCache


def new_cache(model=None):
    """An empty ``DynamicCache`` for ``model`` whose every layer keeps all its entries, sliding-window layers
    included: a sliding layer built from the config drops entries past its window as the verify forward
    appends the tree, and a rejected node's row cannot then be undone. The window is the mask's business
    instead (``verify.layer_masks``, and transformers' own mask where none is passed)."""
    return DynamicCache()


def cache_length(cache) -> int:
    return int(cache.get_seq_length()) if cache is not None else 0


def _slots(cache):
    """(get, set) accessors for each layer's (keys, values), whichever layout this version has."""
    if hasattr(cache, "layers"):
        out = []
        for layer in cache.layers:
            if getattr(layer, "is_sliding", False) and getattr(layer, "cumulative_length", 0) != (
                    0 if layer.keys is None else layer.keys.shape[-2]):
                raise NotImplementedError("KV keep: a sliding-window cache layer has already dropped tokens; "
                                          "speculative rollback needs full-attention layers")

            def get(layer=layer):
                return layer.keys, layer.values

            def put(k, v, layer=layer):
                layer.keys, layer.values = k, v
                if hasattr(layer, "cumulative_length"):
                    layer.cumulative_length = k.shape[-2]
            out.append((get, put))
        return out
    if hasattr(cache, "key_cache"):
        def acc(i):
            def get():
                return cache.key_cache[i], cache.value_cache[i]

            def put(k, v):
                cache.key_cache[i], cache.value_cache[i] = k, v
            return get, put
        return [acc(i) for i in range(len(cache.key_cache))]
    raise TypeError(f"KV keep: unsupported cache type {type(cache).__name__} (need a DynamicCache)")


def crop(cache, length: int) -> None:
    """Truncate the cache to its first ``length`` entries."""
    for get, put in _slots(cache):
        k, v = get()
        if k is not None and k.shape[-2] > length:
            put(k[..., :length, :], v[..., :length, :])


# ---- rows: row b's valid slots are [start_b, length_b); every other slot is masked ----------------------
# One sequence is a batch of one whose slots are all valid (start 0, length = the cache's).

def keep(cache, past_len: int, lengths: list[int], rows: list[torch.Tensor]) -> list[int]:
    """After a verify forward appended its tokens at slots ``past_len``.., move row b's kept verify rows
    ``rows[b]`` (0 = its root) to slots ``lengths[b]``.. and truncate the cache to the longest row. Returns the
    new lengths. Slots past a row's length hold stale entries that its masks never read. Nothing moves when
    every row is as long as the cache and keeps its first verify rows (a chain's accepted prefix)."""
    new = [n + len(r) for n, r in zip(lengths, rows)]
    end = max(new)
    in_place = all(n == past_len and torch.equal(r, torch.arange(len(r))) for n, r in zip(lengths, rows))
    if not in_place:
        width = max(len(r) for r in rows)
        src = torch.stack([torch.cat([r, r[-1:].expand(width - len(r))]) for r in rows]) + past_len
        dst = torch.stack([torch.arange(n, n + width) for n in lengths])  # a padded copy lands past the row's end
    moved: dict = {}  # (device, heads, width) -> the expanded (src, dst) indices: built once per shape
    for get, put in _slots(cache):
        k, v = get()
        if k is None:
            continue
        if not in_place:
            # dst <= src slot by slot and the gather copies first, so no row overwrites an entry it still reads
            for x in (k, v):  # expanded per tensor: MLA caches latents whose keys and values differ in width
                key = (x.device, x.shape[1], x.shape[3])
                if key not in moved:
                    moved[key] = [i.to(x.device)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
                                  for i in (src, dst)]
                i_src, i_dst = moved[key]
                x.scatter_(2, i_dst, x.gather(2, i_src))
        put(k[..., :end, :], v[..., :end, :])
    return new


def row_output(out, b: int, positions, device=None):
    """Row b of a ``TargetOutput`` at sequence ``positions`` (a slice or an index tensor), each per-token feature
    moved to ``device`` (None: where it is), without logits: what a row's drafter reads (which feature a head
    reads is the head's business)."""
    cut = {}
    for f in fields(out):
        v = getattr(out, f.name)
        if f.name != "logits" and isinstance(v, torch.Tensor):
            index = positions if isinstance(positions, slice) else positions.to(v.device)
            cut[f.name] = v[b:b + 1, index].to(device or v.device)
    return replace(out, logits=None, past_key_values=None, **cut)


def select_rows(cache, index: list[int], start: int, end: int) -> None:
    """Keep batch rows ``index`` (in order) and slots [start, end) of every layer."""
    for get, put in _slots(cache):
        k, v = get()
        if k is None:
            continue
        i = torch.tensor(index, device=k.device)
        put(k.index_select(0, i)[..., start:end, :], v.index_select(0, i)[..., start:end, :])
