"""The target's KV cache, preallocated (``RowsCache``): each layer's keys and values live in buffers
[B, heads, capacity, dim] allocated once and written in place, so a step costs no ``torch.cat`` and a rollback is
moving a length. After verification ``keep_accepted`` moves each row's accepted path into contiguous slots and
sets the length.

``RowsCache`` is a transformers ``Cache`` (its layers ``RowsLayer``, a ``CacheLayerMixin``), so a model writes it
from its own attention, on transformers 5.17 and 5.24 alike. Every layer keeps every entry, sliding-window ones
included: the window is the mask's business (``decode.loop.layer_masks``, and transformers' own mask where none is
passed), and a rejected node's entry can then always be undone. Keys and values may differ in width (DeepSeek-V3's
MLA caches its compressed latent as keys and its rotary part as values): each buffer takes its own width. A layer
with indexed sparse attention (DeepSeek-V3.2, GLM-5: DSA) also caches its indexer's keys (``update_indexer``, one
head [B, S, D]), kept in a third buffer beside its keys, slot for slot: the indexer scores its keys under the same
mask as the attention (a tree's too), and what moves or drops one entry moves or drops the others.

Two ways a forward writes it. Eagerly, ``update`` appends at the cache's length and returns the entries up to the
new end (a view, what ``DynamicCache`` would return). Statically (``static_writes(cache, at)``, for a compiled
verify), ``update`` writes at the slots ``at`` + 0.. (``at`` a tensor, so a compiled graph does not see a Python int
change every step) and returns the whole buffer: the caller's mask blocks the unused slots and the caller sets the
length. The head keeps its own ``HeadCache`` (``crop``/``keep``), handled by the drafter.

A target whose layers keep other state (recurrent, indexed, chunked: ``Target.own_cache``) decodes plainly on the
cache its model makes; ``keep_accepted`` takes that cache as long as nothing is to be dropped from it.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class RowsLayer(CacheLayerMixin):
    """One layer's preallocated keys and values; entries [0, length) are the text (a row's own slots are the
    Decoder's business). Grows by doubling when a write would pass the capacity: rare when the capacity was sized
    from the prompt and max_new_tokens (``new_cache(capacity=...)``), and it keeps a draft model that does not
    know its length working."""

    is_sliding = False  # it keeps every entry; masks hide what a window would drop
    is_croppable = True
    is_compileable = False  # eager forwards get transformers' DynamicCache mask shortcuts (a compiled one brings its mask)

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity, self.length = capacity, 0
        self.at = None  # static writes: the slot tensor the next update writes from (set by the cache)
        # DSA's indexer keys [B, 1, capacity, D] (None: the layer has no indexer), slot for slot with the keys; the
        # attention writes its keys before its indexer does, so the indexer's writes count their own length
        self.indexer_keys, self.indexer_length = None, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys = self._buffer(key_states, max(self.capacity, key_states.shape[-2]))
        self.values = self._buffer(value_states, self.keys.shape[-2])
        self.is_initialized = True

    @staticmethod
    def _buffer(like: torch.Tensor, capacity: int) -> torch.Tensor:
        B, H, _, D = like.shape
        return like.new_zeros(B, H, capacity, D)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.at is not None:  # static: the slots are a tensor, the whole buffer is returned
            slots = self.at + torch.arange(key_states.shape[-2], device=self.keys.device)
            self.keys.index_copy_(2, slots, key_states)
            self.values.index_copy_(2, slots, value_states)
            return self.keys, self.values
        end = self.length + key_states.shape[-2]
        self.reserve(end)
        self.keys[:, :, self.length:end] = key_states
        self.values[:, :, self.length:end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def update_indexer(self, key_states: torch.Tensor) -> torch.Tensor:
        """Write an indexed attention's indexer keys [B, S, D] after the entries before them; returns the keys its
        scores read ([B, T, D]: up to the new end, or the whole buffer under static writes)."""
        k = key_states[:, None]
        if self.indexer_keys is None:
            size = self.keys.shape[-2] if self.keys is not None else max(self.capacity, k.shape[-2])
            self.indexer_keys = self._buffer(k, size)
        if self.at is not None:
            slots = self.at + torch.arange(k.shape[-2], device=k.device)
            self.indexer_keys.index_copy_(2, slots, k)
            return self.indexer_keys[:, 0]
        end = self.indexer_length + k.shape[-2]
        self.reserve(end)
        self.indexer_keys[:, :, self.indexer_length:end] = k
        self.indexer_length = end
        return self.indexer_keys[:, 0, :end]

    def buffers(self) -> list[str]:
        """The names of this layer's [B, heads, slots, dim] buffers: keys, values, and an indexer's keys."""
        return ["keys", "values"] + (["indexer_keys"] if self.indexer_keys is not None else [])

    def set_length(self, length: int) -> None:
        self.length = self.indexer_length = length

    def reserve(self, end: int) -> None:
        """Room for ``end`` entries: the buffers double (at least) when they are too short, keeping their entries."""
        if self.keys is None or end <= self.keys.shape[-2]:
            return
        size = max(end, 2 * self.keys.shape[-2])
        for name in self.buffers():
            old = getattr(self, name)
            new = self._buffer(old, size)
            new[:, :, :old.shape[-2]] = old
            setattr(self, name, new)

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.length + query_length, 0  # an eager forward's keys: the text and its queries

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # it grows when it must

    def crop(self, tokens_to_remove: int) -> None:  # transformers' convention: a negative count to drop
        self.set_length(max(0, self.length - abs(tokens_to_remove)))

    def reset(self) -> None:
        self.set_length(0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            for name in self.buffers():
                setattr(self, name, getattr(self, name).index_select(0, beam_idx.to(self.keys.device)))

    batch_select_indices = reorder_cache


class RowsCache(Cache):
    """The target's (or a draft model's) cache: one ``RowsLayer`` per model layer, added as the model first writes
    it, every layer of the same length."""

    def __init__(self, capacity: int = 0):
        super().__init__(layers=[])
        self.capacity = capacity

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:  # the first forward makes them, each from length 0
            self.layers.append(RowsLayer(self.capacity))
        return self.layers[layer_idx].update(key_states, value_states)

    def update_indexer(self, key_states, layer_idx: int):
        """An indexed attention layer's indexer keys (DSA), written beside its keys (``RowsLayer.update_indexer``)."""
        return self.layers[layer_idx].update_indexer(key_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[0].length if self.layers else 0


def new_cache(model=None, capacity: int = 0) -> RowsCache:
    """An empty cache for ``model`` (any transformers causal LM: its layers are made as it writes them) whose
    buffers hold ``capacity`` entries (0: as many as the first forward writes; they double when full)."""
    return RowsCache(capacity)


def _cache_layers(cache) -> list[RowsLayer]:
    if not isinstance(cache, RowsCache):
        raise TypeError(f"KV cache: unsupported cache type {type(cache).__name__} (need new_cache's RowsCache: "
                        "speculative rollback needs a cache that keeps every entry of every layer)")
    return [layer for layer in cache.layers if layer.is_initialized]


def cache_length(cache) -> int:
    return int(cache.get_seq_length()) if cache is not None else 0


def set_cache_length(cache, length: int) -> None:
    for layer in _cache_layers(cache):
        layer.set_length(length)


def cache_entries(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) up to the cache's length: views of its buffers."""
    return [(layer.keys[:, :, :layer.length], layer.values[:, :, :layer.length]) for layer in _cache_layers(cache)]


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` entries (moves the length; the buffers stay)."""
    set_cache_length(cache, min(cache_length(cache), length))


def static_writes(cache, at: torch.Tensor | None, capacity: int | None = None) -> None:
    """Switch ``cache`` to static writes at slots ``at``.. (a 0-d long tensor on the model's device, updated in
    place between forwards), with buffers of exactly ``capacity`` entries (grown now, never inside a compiled
    forward); ``at=None`` switches back to eager appends. Static buffers keep one address (CUDA graphs need it)."""
    for layer in _cache_layers(cache):
        if capacity is not None:
            layer.reserve(capacity)
        layer.at = at
        if at is not None and not torch.compiler.is_compiling():
            for name in layer.buffers():
                torch._dynamo.mark_static_address(getattr(layer, name))


# ---- rows: row b's valid slots are [start_b, length_b); every other slot is masked -------------------------
# One sequence is a batch of one whose slots are all valid (start 0, length = the cache's).

def keep_accepted(cache, past_len: int, lengths: list[int], rows: list[torch.Tensor], written: int | None = None
                  ) -> list[int]:
    """After a verify forward wrote its tokens at slots ``past_len``.., move row b's kept verify rows
    ``rows[b]`` (0 = its root) to slots ``lengths[b]``.. in place and set the cache's length to the longest
    row's. Returns the new lengths. Slots past a row's length hold stale entries that its masks never read.
    Nothing moves when every row is as long as the cache and keeps its first verify rows (a chain's accepted
    prefix)."""
    new = [n + len(r) for n, r in zip(lengths, rows)]
    in_place = all(n == past_len and torch.equal(r, torch.arange(len(r))) for n, r in zip(lengths, rows))
    if not isinstance(cache, RowsCache):  # the model's own cache (Target.own_cache)
        keep_own(cache, in_place and all(len(r) == len(rows[0]) for r in rows), len(rows[0]), written)
        return new
    if not in_place:
        width = max(len(r) for r in rows)
        src = torch.stack([torch.cat([r, r[-1:].expand(width - len(r))]) for r in rows]) + past_len
        dst = torch.stack([torch.arange(n, n + width) for n in lengths])  # a padded copy lands past the row's end
        moved: dict = {}  # (device, heads, width) -> the expanded (src, dst) indices: built once per shape
        for layer in _cache_layers(cache):
            # dst <= src slot by slot and the gather copies first, so no row overwrites an entry it still reads
            for x in map(layer.__getattribute__, layer.buffers()):  # per tensor: MLA's keys and values differ in width
                key = (x.device, x.shape[1], x.shape[3])
                if key not in moved:
                    moved[key] = [i.to(x.device)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
                                  for i in (src, dst)]
                i_src, i_dst = moved[key]
                x.scatter_(2, i_dst, x.gather(2, i_src))
    set_cache_length(cache, max(new))
    return new


def keep_own(cache, prefix: bool, kept: int, written: int | None) -> None:
    """After a verify forward wrote ``written`` tokens into the model's own cache: keep the first ``kept``, which
    must be a prefix of them (a chain's accepted path), by transformers' ``crop``: keys and values cut, recorded
    recurrent and convolution states rolled back (``activate_past_recording`` before the forward). Every step of a
    recording cache crops, 0 tokens too: that is what trims its recorded states."""
    written = kept if written is None else written
    if not prefix or kept > written:
        raise RuntimeError(f"keep_accepted: a {type(cache).__name__} (the model's own cache) keeps a prefix of what a "
                           "forward wrote (a chain's accepted path), not the nodes of a tree")
    recording = any(getattr(layer, "record_past", False) for layer in getattr(cache, "layers", []))
    if written > kept or recording:
        if not hasattr(cache, "crop"):
            raise RuntimeError(f"keep_accepted: a {type(cache).__name__} cannot drop rejected draft entries")
        cache.crop(-(written - kept))


def record_states(cache, positions: int) -> None:
    """Have the model's own cache record its recurrent and convolution states over the next forward's ``positions``
    tokens, so that ``crop`` rolls a rejected tail back. transformers 5.24+ takes how many recurrent states to keep;
    5.17 records convolution windows only (its layers with a recurrent state say they are not croppable, which
    ``Target.chain_refusal`` refuses)."""
    try:
        cache.activate_past_recording(recurrent_states_to_keep=positions)
    except TypeError:
        cache.activate_past_recording()


def select_cache_rows(cache, index: list[int], start: int, end: int) -> None:
    """Keep batch rows ``index`` (in order) and slots [start, end) of every layer, moved to slots [0, end - start)
    of new buffers as long as the old ones."""
    for layer in _cache_layers(cache):
        i = torch.tensor(index, device=layer.keys.device)
        for name in layer.buffers():
            old = getattr(layer, name)
            new = RowsLayer._buffer(old[i], old.shape[-2])
            new[:, :, :end - start] = old[i, :, start:end]
            setattr(layer, name, new)
    set_cache_length(cache, end - start)
