"""What eaglekit needs from a target's architecture, read from its config: the language model's config (a VL
checkpoint's ``text_config``), which attention each layer runs (full, or a sliding window of W tokens), which
attention backend to load it with, and which targets the decode loop cannot yet verify drafts on exactly.

Nothing here stops capture, training or plain decoding: they need a forward with hooks, which every causal LM has.
Speculative decoding appends the draft tree to the target's cache and then drops the rejected nodes. A key/value
cache can drop any of them (rollback is truncation, eaglekit's ``RowsCache``, trees of any shape); a recurrent
state cannot: once a Mamba / linear-attention / short-convolution layer has folded a rejected token into its state,
the state no longer equals the one the accepted tokens alone would give. Indexed sparse attention (DSA) keeps its
indexer's keys beside its keys in ``RowsCache``, so it takes trees too. What ``refusal`` names (recurrent state;
chunked or compressed attention, whose masks and caches the loop does not build for a tree) puts a target on the
cache its own model makes (``Target.own_cache``): plain decoding, and drafts verified with the recurrent state
recorded after each position and the rejected tail cropped (transformers' ``activate_past_recording`` / ``crop``),
a tree one batch row per root-to-leaf path. ``Target.chain_refusal``'s check of the model names where even that is
not the model's own decoding; it stops speculative decoding when it starts, before any token.
"""
from __future__ import annotations

FULL, SLIDING, INDEXED = "full_attention", "sliding_attention", "indexed_attention"
# layer types that attend (their outputs are what DFlash reads on a hybrid: Target.attention_taps)
ATTENTION_KINDS = (FULL, SLIDING, INDEXED, "chunked_attention", "attention")
# layer types whose every cached entry eaglekit's cache keeps and whose mask a tree's mask can be: full and sliding
# attention, and indexed sparse attention (DSA: its indexer scores keys under the same mask before its top-k, and
# caches its own keys, which RowsCache keeps beside the layer's)
TREE_KINDS = {FULL, SLIDING, INDEXED}
# layer types (transformers' ``layer_types`` / ``block_types`` / ``layers_block_type``) whose state is recurrent
RECURRENT_LAYER_TYPES = {"linear_attention", "hybrid", "conv", "recurrent", "mamba", "mamba2", "ssm", "rwkv"}
# config keys only recurrent blocks have (for configs that name no layer types, or list only attention)
RECURRENT_CONFIG_KEYS = ("state_size", "mamba_d_state", "ssm_state_size", "conv_L_cache", "linear_conv_kernel_dim",
                         "conv1d_width", "attn_layer_period", "mamba_expand")
RECURRENT_MODEL_TYPES = {"rwkv", "xlstm"}  # recurrent throughout, their configs have neither of the above
# layers eaglekit does not attend through but that hold no state (NemotronH's blocks are typed so)
STATELESS_LAYER_TYPES = {"mlp", "moe"}


class UnsupportedArchitecture(ValueError):
    """A target the decode loop cannot verify drafts on exactly; raised when speculative decoding starts."""


def text_config(config):
    """The language model's config: a VL checkpoint's ``text_config``, else ``config`` itself."""
    get = getattr(config, "get_text_config", None)
    sub = get() if callable(get) else getattr(config, "text_config", None)
    return sub if sub is not None else config


def layer_types(config) -> list[str]:
    """Each decoder layer's type as the config names it; models that name none run one kind everywhere."""
    config = text_config(config)
    for key in ("layer_types", "block_types", "layers_block_type"):
        types = getattr(config, key, None)
        if types:
            return [str(t) for t in types]
    n = getattr(config, "num_hidden_layers", 0) or 0
    return [FULL if getattr(config, "sliding_window", None) is None else SLIDING] * n


def attention_windows(config) -> dict[str, int | None]:
    """Each attention layer type of the model → the window its layers attend over (None: full attention).

    transformers builds one mask per layer type (a dict keyed by type for models that mix them, one tensor
    for models that do not) and a sliding layer sees key j from query i iff ``i - j < window``."""
    window = getattr(config, "sliding_window", None)
    kinds = sorted(set(layer_types(config)) - STATELESS_LAYER_TYPES)
    return {k: (window if k == SLIDING else None) for k in kinds}


def refusal(config) -> str | None:
    """Why the decode loop cannot verify drafts on this target exactly, or None when it can."""
    config = text_config(config)
    name = getattr(config, "model_type", "?")
    types = set(layer_types(config))
    recurrent = sorted(types & RECURRENT_LAYER_TYPES)
    keys = [k for k in RECURRENT_CONFIG_KEYS if getattr(config, k, None) is not None]
    if recurrent or keys or name in RECURRENT_MODEL_TYPES:
        what = f"layer type {', '.join(recurrent)}" if recurrent else ', '.join(keys) if keys else "its blocks"
        return (f"{name} keeps a recurrent state ({what}): the state takes in every draft token the target "
                "verifies, and truncating a KV cache cannot drop the rejected ones (its model's own cache rolls "
                "them back, a tree one row per path)")
    other = sorted(types - TREE_KINDS - STATELESS_LAYER_TYPES)
    if other:
        return (f"{name}: its {', '.join(other)} layers need an attention mask and cache eaglekit does not build "
                "for a draft tree (supported: full, sliding-window and indexed attention; chains run on its model's "
                "own cache)")
    if SLIDING in types and not getattr(config, "sliding_window", None):
        return f"{name}: sliding-window layers without a sliding_window size in the config"
    return None


def check_decodable(config, where: str = "") -> None:
    """Raise ``UnsupportedArchitecture`` for a target the decode loop cannot verify drafts on exactly (see
    ``refusal``): asked when speculative decoding starts, before any token."""
    reason = refusal(config)
    if reason:
        raise UnsupportedArchitecture(f"{where + ': ' if where else ''}speculative decoding refused: {reason}. "
                                      "Capture, training and plain decoding (no drafter) work on it.")


def attention_implementation(model_cls: type, wanted: str = "sdpa") -> str:
    """``wanted``, unless it is SDPA and ``model_cls`` has no SDPA path (Gemma-2: soft-capped scores; gpt-oss:
    attention sinks): then eager, which takes the same additive float tree mask."""
    if wanted == "sdpa" and not getattr(model_cls, "_supports_sdpa", True):
        return "eager"
    return wanted
