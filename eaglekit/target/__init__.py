"""The target: a causal LM loaded (``load``), its taps and what heads borrow (``model``), and its KV cache
(``cache``). Beside them: ``architectures`` (the language model's config, layer types, and which targets the decode
loop cannot yet verify drafts on), ``borrowed`` (the embedding and lm_head rows a head shares, a target without its
decoder), ``tensor_parallel`` (a target split over processes), ``packed_linear`` (CPU linears packed for oneDNN).

Any causal LM whose forward runs is a target: capture, training and plain decoding never refuse an architecture.
Which layers a head taps is the head's business (``head.taps``); the target knows layer ids, the default set
serving engines assume when a head names none (``default_taps``) and the attention layers' outputs a DFlash head
reads on a hybrid (``Target.attention_taps``).
"""
from eaglekit.target.cache import (
    RowsCache,
    RowsLayer,
    cache_entries,
    cache_length,
    crop_cache,
    keep_accepted,
    keep_own,
    new_cache,
    record_states,
    select_cache_rows,
    set_cache_length,
    static_writes,
)
from eaglekit.target.load import job_device, load_target, load_target_from, resolve
from eaglekit.target.model import CompileError, Target, TargetOutput, cache_kwarg, default_taps, row_output

__all__ = ["CompileError", "RowsCache", "RowsLayer", "Target", "TargetOutput", "cache_entries", "cache_kwarg",
           "cache_length", "crop_cache", "default_taps", "job_device", "keep_accepted", "keep_own", "load_target",
           "load_target_from", "new_cache", "record_states", "resolve", "row_output", "select_cache_rows", "set_cache_length",
           "static_writes"]
