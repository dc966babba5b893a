"""The target: load a causal LM, tap the hidden states an EAGLE head reads, and keep its KV cache. Beside this
module: ``architectures`` (which decode exactly; the refusal of the rest), ``borrowed`` (the embedding and
lm_head rows a head shares), ``tensor_parallel`` (a target split over processes), ``packed_linear`` (CPU linears
packed for oneDNN).

Taps come from forward hooks on the model's own modules (pre-hooks on decoder layers for their
*inputs*, a hook on the final norm for the tensor lm_head reads); no modeling file is copied, so any
architecture with a ``layers`` list and a final ``norm`` works (Llama, Qwen2/3, Mistral, Gemma, Phi...).
Which layers a head taps is the head's business (``head.taps``); this module knows only layer ids,
and the default set serving engines assume when a head names none (``default_taps``).

The target's KV cache, preallocated (``RowsCache``, kept here beside the model that writes it): each layer's keys
and values live in buffers [B, heads, capacity, dim] allocated once and written in place, so a step costs no
``torch.cat`` and a rollback is moving a length. After verification ``keep_accepted`` moves each row's accepted
path into contiguous slots and sets the length; ``row_output`` cuts a row's slice of the target's output, what its
drafter reads.

``RowsCache`` is a transformers ``Cache`` (its layers ``RowsLayer``, a ``CacheLayerMixin``), so a model writes it
from its own attention, on transformers 5.17 and 5.24 alike. Every layer keeps every entry, sliding-window ones
included: the window is the mask's business (``decode.loop.layer_masks``, and transformers' own mask where none is
passed), and a rejected node's entry can then always be undone. Keys and values may differ in width (DeepSeek-V3's
MLA caches its compressed latent as keys and its rotary part as values): each buffer takes its own width.

Two ways a forward writes it. Eagerly, ``update`` appends at the cache's length and returns the entries up to the
new end (a view, what ``DynamicCache`` would return). Statically (``static_writes(cache, at)``, for a compiled
verify), ``update`` writes at the slots ``at`` + 0.. (``at`` a tensor, so a compiled graph does not see a Python int
change every step) and returns the whole buffer: the caller's mask blocks the unused slots and the caller sets the
length. The head keeps its own ``HeadCache`` (``crop``/``keep``), handled by the drafter.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import Cache, CacheLayerMixin

from eaglekit import assets
from eaglekit.config import TargetSpec, parse_dtype
from eaglekit.target import tensor_parallel as tp
from eaglekit.target.architectures import attention_implementation, attention_windows, check_supported
from eaglekit.target.borrowed import RowSubset, load_without_decoder


@functools.cache
def cache_kwarg(model_cls: type) -> str:
    """The name under which ``model_cls.forward`` takes the KV cache: ``cache`` on newer transformers (where
    ``past_key_values`` still works but warns on every forward), ``past_key_values`` on older (5.17)."""
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """The default taps: the inputs of layers (2, N//2, N-3), what vLLM and SGLang assume for EAGLE-3."""
    return (2, num_layers // 2, num_layers - 3)



@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [B, S, V] (or the kept positions)
    last: torch.Tensor  # [B, S, H] the final-norm output lm_head reads (EAGLE-1 feature, teacher)
    taps: torch.Tensor | None  # [B, S, len(layer_ids)*H] the tapped layer inputs, concatenated (EAGLE-3)
    past_key_values: object = None


class Target:
    """A frozen target model with its tokenizer and the taps heads need.

    ``layout`` says how the target is split over processes (``tensor_parallel.Layout``; one process holds it
    whole by default); ``split`` gives a split target the full copies of the modules heads borrow."""

    layout: tp.Layout = tp.SINGLE
    _twins: dict | None = None  # under TP: plain full copies of embed_tokens / lm_head (tensor_parallel.replicate)
    _input_device: torch.device | None = None  # where inputs go when the weights are spread (device_map)

    def __init__(self, model: nn.Module, tokenizer, name: str = "", has_decoder: bool = True):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.has_decoder = has_decoder  # False: only the borrowed modules hold weights (load_target(decoder=False))
        causal = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.config = causal.config
        check_supported(self.config, where=name or type(causal).__name__)
        self.attention_windows = attention_windows(self.config)  # layer type -> sliding window (None: full)
        self.decoder = self.decoder_of(causal)
        self.layers = _find(self.decoder, ("layers", "h", "blocks"), "decoder layers")
        self.norm = self.final_norm(causal)
        self.num_layers = len(self.layers)
        self.hidden_size = self.config.hidden_size
        self.vocab_size = causal.get_output_embeddings().weight.shape[0]
        self.default_taps = default_taps(self.num_layers)

    @staticmethod
    def decoder_of(causal: nn.Module) -> nn.Module:
        return causal.get_decoder() if hasattr(causal, "get_decoder") else causal.model

    @staticmethod
    def final_norm(causal: nn.Module) -> nn.Module:
        return _find(Target.decoder_of(causal), ("norm", "final_layernorm", "final_layer_norm", "ln_f"), "final norm")

    # frozen modules that heads and losses borrow
    @property
    def embed_tokens(self) -> nn.Module:
        return self._twins["embed_tokens"] if self._twins else self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self._twins["lm_head"] if self._twins else self.model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return self._input_device or self._table().device

    def _table(self) -> torch.Tensor:
        emb = self.embed_tokens  # a RowSubset once offline training keeps only the rows it reads
        return emb.rows if isinstance(emb, RowSubset) else emb.weight

    def split(self, layout: tp.Layout) -> Target:
        """Mark this target as split over ``layout``'s TP group: heads then borrow full copies of its
        embedding and lm_head (the split model keeps its own DTensor weights)."""
        self.layout = layout
        if layout.tp_size > 1:
            self._twins = {"embed_tokens": tp.replicate(self.model.get_input_embeddings()),
                           "lm_head": tp.replicate(self.model.get_output_embeddings())}
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self._table().dtype

    def chat_ids(self, messages: list[dict] | str) -> torch.Tensor:
        """Token ids [1, T] of a chat (or one user turn) in the tokenizer's template, ready for a reply."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)["input_ids"]

    def fingerprint(self) -> str:
        """A short hash of what a head depends on: architecture shape and the tokenizer's vocabulary."""
        keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size",
                "num_attention_heads", "num_key_value_heads")
        shape = {k: getattr(self.config, k, None) for k in keys}
        # hashing the whole vocabulary is slow next to a decode step and would run once per generate() call
        # (the head's target check): memoised per (shape, vocabulary size), what changes when either does
        memo = (json.dumps(shape), len(self.tokenizer))
        if getattr(self, "_fingerprint", (None, None))[0] != memo:
            vocab = sorted(self.tokenizer.get_vocab().items(), key=lambda kv: kv[1])
            blob = json.dumps([shape, vocab], ensure_ascii=False).encode()
            self._fingerprint = memo, hashlib.sha256(blob).hexdigest()[:16]
        return self._fingerprint[1]

    @contextlib.contextmanager
    def _taps(self, layer_ids):
        """Record the inputs of ``layer_ids`` and the final norm's output during one forward."""
        seen: dict = {}
        hooks = []

        def pre(i):
            def hook(_mod, args, kwargs):
                seen[i] = args[0] if args else kwargs["hidden_states"]
            return hook

        for i in layer_ids:
            hooks.append(self.layers[i].register_forward_pre_hook(pre(i), with_kwargs=True))
        hooks.append(self.norm.register_forward_hook(lambda _m, _a, out: seen.__setitem__("last", out)))
        try:
            yield seen
        finally:
            for h in hooks:
                h.remove()

    @torch.no_grad()
    def forward(self, input_ids, *, attention_mask=None, position_ids=None, past_key_values=None,
                layer_ids=None, logits: bool = True, logits_to_keep: int = 0) -> TargetOutput:
        """One target forward returning logits (optional), ``last`` and the inputs of ``layer_ids`` as ``taps``.

        ``layer_ids``: the layers to tap (a head's ``taps``; ``()`` taps none, None the default taps).
        ``logits=False`` runs the decoder without the lm_head, which saves the [B, S, V] matmul during capture.
        """
        if not self.has_decoder:
            raise RuntimeError(f"{self.name}: loaded without its decoder (decoder=False, for offline training): "
                               "it cannot run; load it whole")
        layer_ids = self.default_taps if layer_ids is None else tuple(layer_ids)
        kw = {"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": past_key_values is not None}
        cache_name = cache_kwarg(type(self.model if logits else self.decoder))
        if past_key_values is not None:
            kw[cache_name] = past_key_values
        with self._taps(layer_ids) as seen:
            if logits:
                out = self.model(input_ids=input_ids, logits_to_keep=logits_to_keep, **kw)
                lg = out.logits
            else:
                out = self.decoder(input_ids=input_ids, **kw)
                lg = None
        taps = torch.cat([seen[i] for i in layer_ids], dim=-1) if layer_ids else None
        return TargetOutput(lg, seen["last"], taps, getattr(out, cache_name, None))  # output field: same name

    @torch.no_grad()
    def compiled_forward(self, input_ids, *, attention_mask, position_ids, past_key_values, layer_ids=(),
                         mode: str | None = None) -> TargetOutput:
        """``forward`` through ``torch.compile`` (``mode``: torch.compile's, e.g. ``"reduce-overhead"`` for CUDA
        graphs): one graph per input shape, so the caller keeps shapes static (a preallocated cache written at a
        tensor offset, its own 4-D mask, bucketed query lengths). The taps come from hooks registered once per
        target (a hook added per call would change the graph's guards every call). Whatever dynamo or the
        backend cannot compile is one ``CompileError`` naming the model: never a silent eager fallback."""
        fn = self._compiled_fn(tuple(layer_ids), mode)
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs were read already
        self._recording = True
        try:
            logits, last, taps = fn(input_ids, attention_mask, position_ids, past_key_values)
        except Exception as e:  # dynamo's Unsupported, a backend's failure, ... all mean "cannot compile"
            raise CompileError(f"compile=True: torch.compile cannot compile {self.name or type(self.model).__name__}'s "
                               f"verify forward ({type(e).__name__}: {str(e).strip().splitlines()[0][:300]}); "
                               "decode it with compile=False") from e
        finally:
            self._recording = False
            self._tap_store.clear()  # the hooks' references to this forward's tensors (a CUDA graph's outputs)
        if mode == "reduce-overhead":  # a CUDA graph's outputs are overwritten by its next replay
            logits, last, taps = (None if x is None else x.clone() for x in (logits, last, taps))
        return TargetOutput(logits, last, taps, past_key_values)

    def _compiled_fn(self, layer_ids: tuple, mode):
        compiled = self.__dict__.setdefault("_compiled", {})
        if (layer_ids, mode) not in compiled:
            self._tap_hooks()
            store, cache_name = self._tap_store, cache_kwarg(type(self.model))

            def verify_forward(ids, mask, pos, cache):
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                                 **{cache_name: cache})
                taps = torch.cat([store[i] for i in layer_ids], dim=-1) if layer_ids else None
                return out.logits, store["last"], taps

            # one graph per shape (dynamic=False): the caller buckets the shapes, (rows, bucket) pairs are a few
            # dozen at most; past the limit dynamo would run eagerly without a word, so it fails instead
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            torch._dynamo.config.fail_on_recompile_limit_hit = True
            compiled[layer_ids, mode] = torch.compile(verify_forward, mode=mode, dynamic=False, fullgraph=True)
        return compiled[layer_ids, mode]

    def _tap_hooks(self) -> None:
        """Hooks on every layer and the final norm, once, that record into ``_tap_store`` during compiled
        forwards only (``_recording``); eager forwards keep their own per-call hooks (``_taps``)."""
        if getattr(self, "_tap_store", None) is not None:
            return
        self._tap_store, self._recording = {}, False

        def keep(key):
            def hook(_mod, args, kwargs, out=None):
                if self._recording:
                    self._tap_store[key] = out if key == "last" else (args[0] if args else kwargs["hidden_states"])
            return hook

        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(keep(i), with_kwargs=True)
        self.norm.register_forward_hook(keep("last"), with_kwargs=True)

    def features(self, input_ids, attention_mask=None, layer_ids=None) -> TargetOutput:
        """What a head trains on: ``last`` (EAGLE-1 feature, teacher) and ``taps`` (EAGLE-3; ``layer_ids`` as in
        ``forward``)."""
        return self.forward(input_ids, attention_mask=attention_mask, layer_ids=layer_ids, logits=False)


class CompileError(RuntimeError):
    """``compile=True`` asked for a model torch.compile cannot compile."""


def _find(module: nn.Module, names, what: str):
    for n in names:
        if hasattr(module, n):
            return getattr(module, n)
    raise ValueError(f"{type(module).__name__}: cannot find the {what} (looked for {', '.join(names)})")


# ---- the KV cache: preallocated buffers, a rollback moves a length -----------------------------------------

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

    def reserve(self, end: int) -> None:
        """Room for ``end`` entries: the buffers double (at least) when they are too short, keeping their entries."""
        if self.keys is None or end <= self.keys.shape[-2]:
            return
        size = max(end, 2 * self.keys.shape[-2])
        for name in ("keys", "values"):
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
        self.length = max(0, self.length - abs(tokens_to_remove))

    def reset(self) -> None:
        self.length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))

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
        layer.length = length


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
            torch._dynamo.mark_static_address(layer.keys)
            torch._dynamo.mark_static_address(layer.values)


# ---- rows: row b's valid slots are [start_b, length_b); every other slot is masked -------------------------
# One sequence is a batch of one whose slots are all valid (start 0, length = the cache's).

def keep_accepted(cache, past_len: int, lengths: list[int], rows: list[torch.Tensor]) -> list[int]:
    """After a verify forward wrote its tokens at slots ``past_len``.., move row b's kept verify rows
    ``rows[b]`` (0 = its root) to slots ``lengths[b]``.. in place and set the cache's length to the longest
    row's. Returns the new lengths. Slots past a row's length hold stale entries that its masks never read.
    Nothing moves when every row is as long as the cache and keeps its first verify rows (a chain's accepted
    prefix)."""
    new = [n + len(r) for n, r in zip(lengths, rows)]
    in_place = all(n == past_len and torch.equal(r, torch.arange(len(r))) for n, r in zip(lengths, rows))
    if not in_place:
        width = max(len(r) for r in rows)
        src = torch.stack([torch.cat([r, r[-1:].expand(width - len(r))]) for r in rows]) + past_len
        dst = torch.stack([torch.arange(n, n + width) for n in lengths])  # a padded copy lands past the row's end
        moved: dict = {}  # (device, heads, width) -> the expanded (src, dst) indices: built once per shape
        for layer in _cache_layers(cache):
            # dst <= src slot by slot and the gather copies first, so no row overwrites an entry it still reads
            for x in (layer.keys, layer.values):  # per tensor: MLA's keys and values differ in width
                key = (x.device, x.shape[1], x.shape[3])
                if key not in moved:
                    moved[key] = [i.to(x.device)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
                                  for i in (src, dst)]
                i_src, i_dst = moved[key]
                x.scatter_(2, i_dst, x.gather(2, i_src))
    set_cache_length(cache, max(new))
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


def select_cache_rows(cache, index: list[int], start: int, end: int) -> None:
    """Keep batch rows ``index`` (in order) and slots [start, end) of every layer, moved to slots [0, end - start)
    of new buffers as long as the old ones."""
    for layer in _cache_layers(cache):
        i = torch.tensor(index, device=layer.keys.device)
        for name in ("keys", "values"):
            old = getattr(layer, name)
            new = RowsLayer._buffer(old[i], old.shape[-2])
            new[:, :, :end - start] = old[i, :, start:end]
            setattr(layer, name, new)
    set_cache_length(cache, end - start)


# ---- loading -----------------------------------------------------------------------------------------------

def resolve(name_or_path: str | Path) -> tuple[str, dict]:
    """Where to load ``name_or_path`` from: an embedded asset, a .gguf file, a local folder or a Hub id."""
    s = str(name_or_path)
    if s in assets.ASSETS:
        return str(assets.model_dir(s)), {}
    p = Path(s).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file not found: {p}")
        return str(assets.gguf_model_dir(p)), {}
    if p.exists():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} is not a model folder (no config.json)")
        return str(p), {}
    return s, {}  # a Hub id: transformers resolves it (offline from its cache when HF_HUB_OFFLINE=1)


def load_target(name_or_path: str | Path = assets.DEFAULT_TARGET, dtype: torch.dtype | str = torch.float32,
                device="cpu", adapter: str | Path | None = None, merge_adapter: bool = False,
                trust_remote_code: bool = False, attn_implementation: str = "sdpa",
                revision: str | None = None, tp_size: int = 1, device_map: str | dict | None = None,
                max_memory: dict | None = None, offload_folder: str | Path | None = None,
                only_tp: bool = False, decoder: bool = True) -> Target:
    """Load a target: embedded name, local HF folder, Hub id or .gguf file, plus an optional LoRA.

    ``adapter`` is a PEFT adapter folder, kept live (``merge_adapter=False``) or merged into the weights.
    ``dtype``: a torch dtype or its name (``"bfloat16"``).
    ``tp_size`` > 1 splits the model over each group of ``tp_size`` launched processes with transformers'
    tensor-parallel plan (eaglekit.tensor_parallel; ``only_tp``: the launch must be exactly one group);
    ``device`` is then each process's own. ``device_map`` (e.g. ``"auto"``) with ``max_memory`` and
    ``offload_folder`` spreads it over devices, CPU and disk instead (accelerate's big-model placement).
    ``decoder=False`` reads only what a head borrows (embedding, final norm, lm_head; eaglekit.target.borrowed):
    enough to train from captured features, not to run the model.
    """
    path, _ = resolve(name_or_path)
    kw = {"trust_remote_code": trust_remote_code, "revision": revision}
    config = AutoConfig.from_pretrained(path, **kw)
    check_supported(config, where=str(name_or_path))  # before any weight is read
    layout = _check_split(name_or_path, config, tp_size, device_map, adapter, only_tp)
    tokenizer = AutoTokenizer.from_pretrained(path, **kw)
    kw.update(dtype=parse_dtype(dtype), attn_implementation=attention_implementation(_model_class(config),
                                                                                      attn_implementation))
    if not decoder:
        if layout.tp_size > 1 or device_map is not None or adapter is not None:
            raise ValueError(f"{name_or_path}: decoder=False reads the borrowed modules only; it takes no tp_size, "
                             "device_map or adapter")
        model = load_without_decoder(path, config, kw["dtype"], device, kw["attn_implementation"],
                                     Target.final_norm, revision=revision)
        return Target(model, tokenizer, name=str(name_or_path), has_decoder=False)
    if layout.tp_size > 1:
        model = AutoModelForCausalLM.from_pretrained(path, **kw, **tp.from_pretrained_kwargs(layout))
        tp.settle(model)
    elif device_map is not None:
        model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map, max_memory=max_memory,
                                                     offload_folder=offload_folder, **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kw).to(device)
    if adapter is not None:
        from peft import PeftModel  # an optional dependency, needed only with an adapter

        model = PeftModel.from_pretrained(model, str(adapter)).to(device)
        if merge_adapter:
            model = model.merge_and_unload()
    target = Target(model, tokenizer, name=str(name_or_path)).split(layout)
    if device_map is not None:
        target._input_device = _first_device(model)
    return target


def _check_split(name, config, tp_size: int, device_map, adapter, only_tp: bool) -> tp.Layout:
    """The launch layout for ``tp_size``, after refusing what cannot be split so (before any weight is read)."""
    layout = tp.launch_layout(tp_size, only_tp=only_tp)
    if tp_size == 1:
        return layout
    if device_map is not None:
        raise ValueError(f"{name}: target.tp_size={tp_size} and target.device_map={device_map!r} are two ways to "
                         "split a target; give one")
    if adapter is not None:
        raise ValueError(f"{name}: an adapter with target.tp_size={tp_size} is not supported; merge it into a saved "
                         "model first (PeftModel.merge_and_unload, save_pretrained) and load that")
    tp.check_model(config, tp_size, str(name))
    return layout


def _model_class(config) -> type:
    """The causal-LM class transformers builds for ``config`` (``object`` when it maps none, e.g. remote code)."""
    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return object


def _first_device(model) -> torch.device:
    """Where inputs go for a model spread by a device map: the first placed module's device (a module
    offloaded to the CPU or disk runs on the CPU)."""
    for where in getattr(model, "hf_device_map", {}).values():
        if isinstance(where, int):
            return torch.device("cuda", where)
        if where not in ("cpu", "disk"):
            return torch.device(where)
    return torch.device("cpu")


def job_device(device: str | None, default: str = "cpu") -> str:
    """A job's device: ``device`` or ``default``; ``"cuda"`` under a launcher is this process's GPU."""
    device = device or default
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        return f"cuda:{os.environ['LOCAL_RANK']}"
    return device


def load_target_from(spec: TargetSpec | str, device=None, decoder: bool = True) -> Target:
    """The target a config's ``target:`` section describes (a plain name works); ``device`` (e.g. a
    trainer's accelerator device) wins over the section's, which defaults to the CPU."""
    spec = TargetSpec(name=spec) if isinstance(spec, str) else spec
    return load_target(spec.name, dtype=spec.dtype, device=device or job_device(spec.device),
                       adapter=spec.adapter, merge_adapter=spec.merge_adapter,
                       trust_remote_code=spec.trust_remote_code, revision=spec.revision, tp_size=spec.tp_size,
                       device_map=spec.device_map, max_memory=spec.max_memory, offload_folder=spec.offload_folder,
                       decoder=decoder)
