"""The target model and its taps: ``Target`` wraps any transformers causal LM (a VL checkpoint's language model
included) and records, with forward hooks on the model's own modules, what heads read: the inputs of chosen
decoder layers (``taps``) and the tensor the lm_head reads (``last``). No modeling file is copied.

What it hooks is found from the model's own structure, one mechanism for every family: the decoder layers are the
first module list (depth first, under the model's decoder, ``get_decoder()``) as long as the config's layer count;
``last`` is the decoder's output (its ``last_hidden_state``: what a causal-LM class hands its lm_head, after the
final norm whatever it is called), and a features forward ends at the lm_head's input (a pre-hook on
``get_output_embeddings()``); the final norm (only a warm start for heads) is the decoder's child that is one, or
None. A stack found under an ``encoder`` (BERT-style models built as decoders) is refused by name.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from eaglekit.target import tensor_parallel as tp
from eaglekit.target.architectures import (
    ATTENTION_KINDS,
    attention_windows,
    layer_types,
    refusal,
    text_config,
)
from eaglekit.target.borrowed import RowSubset
from eaglekit.target.cache import record_states


@functools.cache
def cache_kwarg(model_cls: type) -> str:
    """The name under which ``model_cls.forward`` takes the KV cache: ``cache`` on newer transformers (where
    ``past_key_values`` still works but warns on every forward), ``past_key_values`` on older (5.17)."""
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def default_taps(num_layers: int) -> tuple[int, ...]:
    """The default taps: the inputs of layers (2, N//2, N-3), what vLLM and SGLang assume for EAGLE-3 (hybrids
    included: vLLM's Qwen3.5 taps the same). A target too shallow for them (tiny test models) gets their
    in-range ones."""
    taps = (2, num_layers // 2, num_layers - 3)
    if all(0 <= t < num_layers for t in taps):
        return taps
    return tuple(sorted({min(max(t, 0), num_layers - 1) for t in taps}))


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [B, S, V] (or the kept positions)
    last: torch.Tensor  # [B, S, H] what the lm_head reads (the final norm's output; EAGLE-1 feature, teacher)
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
        self.model_config = causal.config  # the checkpoint's own (a VL model's, with its text_config)
        self.config = text_config(causal.config)  # the language model's: layers, widths, layer types
        where = name or type(causal).__name__
        self.attention_windows = attention_windows(self.config)  # layer type -> sliding window (None: full)
        # why the decode loop cannot verify trees on it (None: it can, on eaglekit's cache); capture, training and
        # plain decoding never ask. Such a target decodes on the model's own cache (``own_cache``): plainly, and
        # chains of drafts where ``chain_refusal`` finds nothing against it
        self.decode_refusal = refusal(self.config)
        self.own_cache = self.decode_refusal is not None
        self.decoder = self.decoder_of(causal)
        self.layers = decoder_layers(self.decoder, self.config, where)
        self.norm = self.final_norm(causal)
        self.num_layers = len(self.layers)
        head = causal.get_output_embeddings()
        if head is None or getattr(head, "weight", None) is None:
            raise ValueError(f"{where}: {type(causal).__name__} has no output embedding (lm_head): eaglekit reads "
                             "the tensor it is fed and its vocabulary")
        self._lm_head_module = head  # the module the forward runs (hooked), whatever heads borrow
        self.hidden_size = int(getattr(self.config, "hidden_size", 0) or head.weight.shape[1])
        self.vocab_size = head.weight.shape[0]
        self.default_taps = default_taps(self.num_layers)

    @staticmethod
    def decoder_of(causal: nn.Module) -> nn.Module:
        """The module that runs the decoder layers (a VL model's language model): ``get_decoder()``, else the base
        model, the first of them that holds a module list (a BERT-style head's ``decoder`` is its output linear)."""
        try:
            decoder = causal.get_decoder()
        except (AttributeError, NotImplementedError):
            decoder = None
        for candidate in (decoder, getattr(causal, "model", None), getattr(causal, "base_model", None)):
            if (isinstance(candidate, nn.Module) and candidate is not causal  # Llama 4's get_decoder() is itself
                    and any(isinstance(m, nn.ModuleList) for m in candidate.modules())):
                return candidate
        return causal

    @staticmethod
    def final_norm(causal: nn.Module) -> nn.Module | None:
        """The decoder's final norm (heads copy its weight as a warm start), or None where it has none."""
        return final_norm(Target.decoder_of(causal))

    def chain_refusal(self) -> str | None:
        """Why chains of drafts cannot be verified exactly on this own-cache target (None: they can; always None
        for a target on eaglekit's own cache, whose trees are verified too). A chain is verified in one forward
        over the model's own cache with its recurrent states recorded, and the rejected tail cropped
        (transformers' ``activate_past_recording`` / ``crop``): a check of the model itself, once per target — its
        cache croppable, and a 4-token chunk over a cache, cropped back, giving the logits of decoding those tokens
        one at a time."""
        if not self.own_cache:
            return None
        if "_chain_refusal" not in self.__dict__:
            self._chain_refusal = self._check_chunk_rollback()
        return self._chain_refusal

    @torch.no_grad()
    def _check_chunk_rollback(self) -> str | None:
        vocab = min(self.vocab_size, 512)
        ids = (torch.arange(12, device=self.device) * 37 + 11) % vocab
        prefix, chunk = ids[None, :8], ids[None, 8:]

        name = cache_kwarg(type(self.model))

        def run(x, cache=None):
            out = self.model(input_ids=x, use_cache=True, **({name: cache} if cache is not None else {}))
            return out.logits[0].float(), getattr(out, name, None)

        _, cache = run(prefix)
        if cache is None:
            return (f"{self.config.model_type}: its model returns no cache (it keeps its state inside), so nothing "
                    "can roll a rejected draft back")
        if not hasattr(cache, "activate_past_recording") or not getattr(cache, "is_croppable", False):
            kinds = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])
                            if not getattr(layer, "is_croppable", True)})
            return (f"{self.config.model_type}: its cache{' layers ' + ', '.join(kinds) if kinds else ''} cannot be "
                    f"rolled back (transformers marks {'them' if kinds else 'it'} not croppable), so a rejected "
                    "draft's state stays")
        one = [run(chunk[:, :1], cache)[0][-1]]
        for j in range(1, chunk.shape[1]):
            one.append(run(chunk[:, j:j + 1], cache)[0][-1])
        _, cache = run(prefix)
        record_states(cache, chunk.shape[1])
        try:
            together = run(chunk, cache)[0]
            cache.crop(-(chunk.shape[1] - 1))  # keep the first token, as a step that accepted nothing would
            again = run(chunk[:, 1:2], cache)[0][-1]
        except Exception as e:  # noqa: BLE001 - a layer that records no past: any failure means no rollback
            return (f"{self.config.model_type}: rolling its cache back after a chunk failed "
                    f"({type(e).__name__}: {str(e)[:160]})")
        want = torch.stack(one)
        err = max(float((together - want).abs().max()), float((again - want[1]).abs().max()))
        # float rounding differs between a chunk and single tokens; a wrong state differs by the logits' own scale
        tol = (1e-4 if self.dtype in (torch.float32, torch.float64) else 2e-2) * max(1.0, float(want.abs().max()))
        if err > tol:
            return (f"{self.config.model_type}: its forward over a chunk of tokens (or after rolling one back) gives "
                    f"other logits than decoding them one at a time (max difference {err:.3g}), so a verify "
                    "forward would not reproduce its own decoding")
        return None

    def attention_taps(self, taps) -> tuple[int, ...]:
        """``taps`` moved to the nearest tap that reads an attention layer's output (the input of the layer after
        it; ties to the earlier one), distinct and sorted. What DFlash reads on a hybrid (SpecForge's Qwen3.5
        DFlash configs tap full-attention layers only); a target whose layers are all attention keeps ``taps``."""
        kinds = layer_types(self.config)
        if len(kinds) < self.num_layers:  # a config that names no type per layer: attention everywhere
            return tuple(taps)
        after = [i + 1 for i, k in enumerate(kinds) if k in ATTENTION_KINDS and i + 1 < self.num_layers]
        if not after or len(after) == self.num_layers - 1:
            return tuple(taps)
        return tuple(sorted({min(after, key=lambda a: (abs(a - t), a)) for t in taps}))

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
    def _taps(self, layer_ids, stop_at_lm_head: bool = False):
        """Record the inputs of ``layer_ids`` and the lm_head's input during one forward (``stop_at_lm_head``:
        end the forward there)."""
        seen: dict = {}
        hooks = []

        def pre(i):
            def hook(_mod, args, kwargs):
                seen[i] = args[0] if args else kwargs["hidden_states"]
            return hook

        def decoder_output(_mod, _args, out):
            if _last_hidden(out) is not None:
                seen["last"] = _last_hidden(out)

        def lm_head_input(_mod, args, kwargs):
            if "last" not in seen:  # a decoder that is not the module the forward ran: what the lm_head reads
                seen["last"] = args[0] if args else next(iter(kwargs.values()))
            if stop_at_lm_head:
                raise _LmHeadReached  # its [B, S, V] product is not wanted (features)

        for i in layer_ids:
            hooks.append(self.layers[i].register_forward_pre_hook(pre(i), with_kwargs=True))
        hooks.append(self.decoder.register_forward_hook(decoder_output))
        hooks.append(self._lm_head_module.register_forward_pre_hook(lm_head_input, with_kwargs=True))
        try:
            yield seen
        finally:
            for h in hooks:
                h.remove()

    @torch.no_grad()
    def forward(self, input_ids, *, attention_mask=None, position_ids=None, past_key_values=None,
                layer_ids=None, logits: bool = True, logits_to_keep: int = 0, use_cache: bool | None = None
                ) -> TargetOutput:
        """One target forward returning logits (optional), ``last`` and the inputs of ``layer_ids`` as ``taps``.

        ``layer_ids``: the layers to tap (a head's ``taps``; ``()`` taps none, None the default taps).
        ``logits=False`` stops the forward at the lm_head's input, which saves the [B, S, V] matmul during capture.
        ``use_cache`` (default: whether a cache is passed) with no cache lets the model make its own, returned in
        ``past_key_values`` (``own_cache`` targets' plain decoding).
        """
        if not self.has_decoder:
            raise RuntimeError(f"{self.name}: loaded without its decoder (decoder=False, for offline training): "
                               "it cannot run; load it whole")
        layer_ids = self.default_taps if layer_ids is None else tuple(layer_ids)
        use_cache = past_key_values is not None if use_cache is None else use_cache
        kw = {"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": use_cache}
        cache_name = cache_kwarg(type(self.model))
        if past_key_values is not None:
            kw[cache_name] = past_key_values
        out = None
        with self._taps(layer_ids, stop_at_lm_head=not logits) as seen:
            try:
                out = self.model(input_ids=input_ids, logits_to_keep=logits_to_keep, **kw)
            except _LmHeadReached:
                pass
        missing = [i for i in (*layer_ids, "last") if i not in seen]
        if missing:
            raise RuntimeError(f"{self.name}: the forward did not run {missing} (taps are layer inputs, 'last' the "
                               "decoder's output; a layer the forward skips, as mllama's cross-attention layers on "
                               "text, has none)")
        for key in (*layer_ids, "last"):
            if tuple(seen[key].shape[:2]) != tuple(input_ids.shape[:2]):
                what = "the decoder's output" if key == "last" else f"layer {key}'s input"
                raise ValueError(f"{self.name}: {what} is {list(seen[key].shape)} for token ids "
                                 f"{list(input_ids.shape)}: its layers carry another stream layout (XLNet's [S, B, H], "
                                 "ProphetNet's n-gram streams, CPM-Ant's prompt positions), not one row per token a "
                                 "head reads")
        taps = torch.cat([_stream(seen[i]) for i in layer_ids], dim=-1) if layer_ids else None
        past = getattr(out, cache_name, None) if out is not None else None  # output field: same name
        return TargetOutput(out.logits if out is not None else None, _stream(seen["last"]), taps, past)

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
        """Pre-hooks on every layer and a hook on the decoder's output, once, that record into ``_tap_store`` during compiled
        forwards only (``_recording``); eager forwards keep their own per-call hooks (``_taps``)."""
        if getattr(self, "_tap_store", None) is not None:
            return
        self._tap_store, self._recording = {}, False

        def keep(key):
            def hook(_mod, args, kwargs):
                if self._recording:
                    self._tap_store[key] = args[0] if args else kwargs["hidden_states"]
            return hook

        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(keep(i), with_kwargs=True)

        def keep_last(_mod, _args, out):
            if self._recording:
                self._tap_store["last"] = _last_hidden(out)

        self.decoder.register_forward_hook(keep_last)

    def features(self, input_ids, attention_mask=None, layer_ids=None) -> TargetOutput:
        """What a head trains on: ``last`` (EAGLE-1 feature, teacher) and ``taps`` (EAGLE-3; ``layer_ids`` as in
        ``forward``)."""
        return self.forward(input_ids, attention_mask=attention_mask, layer_ids=layer_ids, logits=False)


class CompileError(RuntimeError):
    """``compile=True`` asked for a model torch.compile cannot compile."""


def _last_hidden(out) -> torch.Tensor | None:
    """The decoder's final hidden state from its output: what every causal-LM class hands its lm_head (at the
    positions it keeps). None for an output with logits (a decoder that is the causal LM itself): the lm_head's
    input is read instead."""
    if isinstance(out, torch.Tensor):
        return out
    if getattr(out, "logits", None) is not None:
        return None
    last = getattr(out, "last_hidden_state", None)
    return last if last is not None else out[0]


class _LmHeadReached(Exception):
    """Ends a features forward at the lm_head's input (raised by its pre-hook, caught by ``forward``)."""


def _stream(x: torch.Tensor) -> torch.Tensor:
    """A residual stream as [B, S, H]: models with several parallel streams (hyper-connections, [B, S, n, H])
    hand their layers all of them; heads read their mean, one H-wide feature per token."""
    return x.mean(dim=-2) if x.dim() == 4 else x


_FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f", "final_norm")


def decoder_layers(decoder: nn.Module, config, where: str) -> nn.ModuleList:
    """The decoder's layer stack: the first module list under ``decoder`` (depth first, so a stack before the
    experts inside its layers) as long as the config's layer count, else the longest. One under an ``encoder`` of
    a config with an ``is_decoder`` switch is an encoder's (BERT and kin built as decoders): refused."""
    n = getattr(config, "num_hidden_layers", None)
    lists = [(name, m) for name, m in decoder.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{where}: cannot find the decoder layers ({type(decoder).__name__} holds no module list)")
    name, layers = next(((nm, m) for nm, m in lists if len(m) == n), max(lists, key=lambda x: len(x[1])))
    # BERT and kin switch a bidirectional encoder to causal with ``is_decoder``; CPM-Ant's decoder stack is merely
    # named ``encoder`` and has no such switch
    if "is_decoder" in vars(config) and ("encoder" in name.split(".") or "Encoder" in type(decoder).__name__):
        raise ValueError(f"{where}: its layers are an encoder's ({type(decoder).__name__}.{name}), a BERT-style "
                         "model built as a decoder: eaglekit trains heads for decoder-only causal LMs")
    return layers


def final_norm(decoder: nn.Module) -> nn.Module | None:
    """``decoder``'s final norm: a child under a usual name, else its last child whose class is a norm."""
    for name in _FINAL_NORMS:
        m = getattr(decoder, name, None)
        if isinstance(m, nn.Module):
            return m
    norms = [m for _, m in decoder.named_children() if "norm" in type(m).__name__.lower()]
    return norms[-1] if norms else None


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
