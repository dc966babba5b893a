"""The architecture matrix: a tiny random model of each architecture eaglekit decodes exactly (``MATRIX``), of each
family it trains for and decodes plainly but does not yet verify drafts on (``FAMILIES``: hybrids, indexed,
chunked and compressed attention), all built from transformers' own config classes (no downloads), and the
docs/inputs.md table they produce (scripts/arch_table.py writes it, tests/target/test_model_architectures.py
checks it).

Every tiny model: hidden 64, vocabulary 512, 2 layers (FAMILIES: 4, so every one mixes its layer kinds). Sliding
windows and chunks are WINDOW tokens, shorter than the test prompts, so every such layer runs past its window.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

WINDOW = 8
BASE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 6, "bos_token_id": 2}
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}


@dataclass(frozen=True)
class Arch:
    config: str  # transformers config class
    model_class: str  # its causal-LM class (what a config.json's "architectures" names)
    examples: str  # real models of this architecture
    features: str  # what in it the decode path has to respect
    kw: dict = field(default_factory=dict)


MATRIX = {
    "llama": Arch("LlamaConfig", "LlamaForCausalLM", "Llama 3.x, SmolLM2", "GQA"),
    "mistral": Arch("MistralConfig", "MistralForCausalLM", "Mistral 7B v0.1", "sliding window (all layers)",
                    {"sliding_window": WINDOW}),
    "qwen2": Arch("Qwen2Config", "Qwen2ForCausalLM", "Qwen2.5, Qwen2.5-Coder", "QKV bias"),
    "qwen3": Arch("Qwen3Config", "Qwen3ForCausalLM", "Qwen3 dense", "QK norm", {"head_dim": 16}),
    "qwen3_moe": Arch("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "Qwen3-30B-A3B, Qwen3-235B-A22B", "MoE, QK norm",
                      dict(head_dim=16, num_experts=4, decoder_sparse_step=1, **MOE)),
    "mixtral": Arch("MixtralConfig", "MixtralForCausalLM", "Mixtral 8x7B", "MoE",
                    {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gemma2": Arch("Gemma2Config", "Gemma2ForCausalLM", "Gemma 2", "soft-capping, eager only, sliding/full layers",
                   {"head_dim": 16, "sliding_window": WINDOW}),
    "phi3": Arch("Phi3Config", "Phi3ForCausalLM", "Phi-3, Phi-4", "fused QKV"),
    "olmo2": Arch("Olmo2Config", "Olmo2ForCausalLM", "OLMo 2", "post-norm, QK norm"),
    "gpt_oss": Arch("GptOssConfig", "GptOssForCausalLM", "gpt-oss-20b/120b",
                    "MoE, attention sinks, eager only, sliding/full layers",
                    {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW}),
    # MLA has no grouped KV heads: num_key_value_heads = num_attention_heads, as in DeepSeek-V3's own config
    "deepseek_v3": Arch("DeepseekV3Config", "DeepseekV3ForCausalLM", "DeepSeek-V3, R1, Kimi K2",
                        "MLA (latent KV cache), MoE",
                        dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                             qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_group=1, topk_group=1,
                             first_k_dense_replace=1, n_shared_experts=1, **MOE)),
    "glm4": Arch("Glm4Config", "Glm4ForCausalLM", "GLM-4-0414", "post-norms, partial RoPE", {"head_dim": 16}),
    "gemma3": Arch("Gemma3TextConfig", "Gemma3ForCausalLM", "Gemma 3 (text)", "sliding/full layers, QK norm",
                   {"head_dim": 16, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}),
    "glm4_moe": Arch("Glm4MoeConfig", "Glm4MoeForCausalLM", "GLM-4.5, GLM-4.6", "MoE, partial RoPE",
                     {"head_dim": 16, "n_routed_experts": 4, "first_k_dense_replace": 1, "n_group": 1,
                      "topk_group": 1, **MOE}),
}

# The 2026 families and the other non-attention targets: they capture, train every head kind and decode plainly
# (on their model's own cache); speculative decoding is refused when it starts (architectures.refusal says why).
# 4 layers each, so every one mixes its layer kinds.
FAMILY_LAYERS = 4
LINEAR = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]  # Qwen3.5's 3:1 pattern
GDN = {"head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
       "linear_value_head_dim": 16, "layer_types": LINEAR}
MLA = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
# DSA's indexer: 16 heads, not 2: its scores are a sum of ReLUs, and with few heads many keys score exactly 0, a tie
# at the top-k boundary that torch.topk breaks by the row's length (a verify chunk and one-token decoding then pick
# different keys: measured 0.42 in the logits with 2 heads, 2.7e-7 with 16; DeepSeek-V3.2 has 64, GLM-5 32)
DSA = dict(num_key_value_heads=4, head_dim=8, index_topk=4, index_head_dim=16, index_n_heads=16, n_routed_experts=4,
           n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, **MLA, **MOE)
FAMILIES = {
    "qwen3_5_text": Arch("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "Qwen3.5 / 3.6 (text)",
                         "Gated DeltaNet + gated attention", GDN),
    "qwen3_5_moe_text": Arch("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "Qwen3.5-35B-A3B, 122B-A10B (text)",
                             "Gated DeltaNet + gated attention, MoE", dict(num_experts=4, **GDN, **MOE)),
    "qwen3_next": Arch("Qwen3NextConfig", "Qwen3NextForCausalLM", "Qwen3-Next", "Gated DeltaNet + attention, MoE",
                       dict(num_experts=4, **GDN, **MOE)),
    "nemotron_h": Arch("NemotronHConfig", "NemotronHForCausalLM", "Nemotron-H, Nemotron 3",
                       "Mamba-2 + attention + MLP blocks",
                       {"hybrid_override_pattern": "M*M-", "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8,
                            "n_groups": 1, "head_dim": 16}),
    "llama4_text": Arch("Llama4TextConfig", "Llama4ForCausalLM", "Llama 4 Scout / Maverick (text)",
                        "chunked attention (no-RoPE full layers), MoE",
                        {"head_dim": 16, "attention_chunk_size": WINDOW, "num_local_experts": 2, "interleave_moe_layer_step": 2,
                             "intermediate_size_mlp": 128, "num_experts_per_tok": 1}),
    "deepseek_v32": Arch("DeepseekV32Config", "DeepseekV32ForCausalLM", "DeepSeek-V3.2",
                         "indexed sparse attention (DSA), MLA, MoE", DSA),
    "glm_moe_dsa": Arch("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", "GLM-5", "indexed sparse attention (DSA), MLA, MoE",
                        DSA),
    "deepseek_v4": Arch("DeepseekV4Config", "DeepseekV4ForCausalLM", "DeepSeek-V4",
                        "compressed sparse attention, hyper-connections (residual [B, S, n, H]), MoE",
                        dict(num_key_value_heads=1, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2,
                             o_lora_rank=16, hc_mult=2, sliding_window=WINDOW, index_topk=4, index_head_dim=16,
                             index_n_heads=2, n_routed_experts=4, n_shared_experts=1,
                             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                             layer_types=["sliding_attention", "compressed_sparse_attention",
                                          "heavily_compressed_attention", "sliding_attention"], **MOE)),
    "kimi_linear": Arch("KimiLinearConfig", "KimiLinearForCausalLM", "Kimi-Linear", "Kimi delta attention + MLA, MoE",
                        {"num_key_value_heads": 4, "linear_head_dim": 16, "linear_num_heads": 4, "num_experts": 4,
                             "num_experts_per_token": 2, "moe_intermediate_size": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                             "qk_nope_head_dim": 8, "v_head_dim": 16,
                             "layer_types": ["linear_attention", "full_attention"] * 2}),
    "lfm2": Arch("Lfm2Config", "Lfm2ForCausalLM", "LFM2, LFM2.5", "short convolutions + attention",
                 {"layer_types": ["conv", "full_attention"] * 2}),
    "falcon_h1": Arch("FalconH1Config", "FalconH1ForCausalLM", "Falcon-H1", "Mamba-2 and attention in each layer",
                      {"mamba_d_state": 4, "mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16,
                       "mamba_n_groups": 1, "head_dim": 16}),
    "granitemoehybrid": Arch("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", "Granite 4.0",
                             "Mamba-2 + attention, MoE",
                             {"layer_types": ["mamba", "attention"] * 2, "mamba_n_heads": 8, "mamba_d_head": 16,
                                  "mamba_d_state": 8, "mamba_n_groups": 1, "num_local_experts": 2, "num_experts_per_tok": 1}),
    "jamba": Arch("JambaConfig", "JambaForCausalLM", "Jamba", "Mamba + attention layers, MoE",
                  {"attn_layer_period": 2, "attn_layer_offset": 1, "num_experts": 2, "expert_layer_period": 2,
                   "mamba_d_state": 4, "mamba_dt_rank": 8}),
    "mamba": Arch("MambaConfig", "MambaForCausalLM", "Mamba", "state-space layers only", {"state_size": 4}),
}
# a VL checkpoint of Qwen3.5's own class (Qwen3_5ForConditionalGeneration with a text_config), for text
VL_TEXT = {**BASE, "num_hidden_layers": FAMILY_LAYERS, **GDN}
VL_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}


def config(arch: Arch):
    import transformers

    layers = {"num_hidden_layers": FAMILY_LAYERS} if arch in FAMILIES.values() else {}
    return getattr(transformers, arch.config)(**{**BASE, **layers, **arch.kw})


def tiny_model(name: str, seed: int = 0):
    """The matrix's (or FAMILIES') tiny random ``name`` model, fp32, with the attention backend load_target would
    pick."""
    from transformers import AutoModelForCausalLM

    from eaglekit.target.architectures import attention_implementation

    cfg = config(MATRIX[name] if name in MATRIX else FAMILIES[name])
    attn = attention_implementation(AutoModelForCausalLM._model_mapping[type(cfg)])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn).eval()


_TARGETS: dict = {}


def tiny_target_of(name: str):
    """The matrix's (or FAMILIES') tiny ``name`` model as a Target with the 512-token tiny tokenizer, one per
    session (the tests only read it)."""
    from helpers import tiny_tokenizer

    from eaglekit.target import Target

    if name not in _TARGETS:
        _TARGETS[name] = Target(tiny_model(name), tiny_tokenizer(BASE["vocab_size"]), name=f"tiny-{name}")
    return _TARGETS[name]


def tiny_vl_model(seed: int = 0):
    """A tiny random Qwen3.5 VL checkpoint's model (``Qwen3_5ForConditionalGeneration``: vision tower, language
    model under ``model.language_model``, lm_head)."""
    import transformers

    cfg = transformers.Qwen3_5Config(text_config=VL_TEXT, vision_config=VL_VISION, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.Qwen3_5ForConditionalGeneration(cfg).eval()


# ---- the docs/inputs.md table-------------------------------------------------------------------------------
ENGINE_COLUMNS = (("vllm", "vLLM 0.33"), ("sglang", "SGLang 0.5.23"))
TABLE_BEGIN = "<!-- architectures table: generated by scripts/arch_table.py from tests/arch_matrix.py -->"
TABLE_END = "<!-- end of architectures table -->"


def table() -> str:
    """The supported-architectures table in Markdown: every matrix row decodes exactly (the tests say so);
    the engine columns come from export.engines, the refused rows from the refusal."""
    from eaglekit.export.engines import ENGINES

    heads = ["Architecture", "Examples", "What the decode path respects", "eaglekit"]
    heads += [f"{label} EAGLE-3 export" for _, label in ENGINE_COLUMNS]
    rows = [heads, ["---"] * len(heads)]
    for a in MATRIX.values():
        engines = ["yes" if a.model_class in ENGINES[e].targets else "refused" for e, _ in ENGINE_COLUMNS]
        rows.append([f"`{a.model_class}`", a.examples, a.features, "exact"] + engines)
    for name, a in FAMILIES.items():
        engines = ["yes" if a.model_class in ENGINES[e].targets else "refused" for e, _ in ENGINE_COLUMNS]
        rows.append([f"`{a.model_class}`", a.examples, a.features, f"trains, plain; {family_decoding(name)}"]
                    + engines)
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)



def family_decoding(name: str) -> str:
    """What speculative decoding does on a family's tiny model: chains and trees verified exactly, or refused
    with the kind of its reason (``Target.chain_refusal``: from the config, then a check of the model)."""
    from helpers import tiny_tokenizer

    from eaglekit.target import Target

    target = Target(tiny_model(name), tiny_tokenizer(BASE["vocab_size"]), name=name)
    if not target.own_cache:
        return "trees exact"
    why = target.chain_refusal()
    if why is None:
        return "chains and trees exact (a row per path)"
    kind = ("cache not croppable" if "cannot be rolled back" in why
            else "cache rollback failed" if "rolling its cache back" in why else "chunk forward is not its decoding")
    return f"speculative refused ({kind})"


def readme_block() -> str:
    return f"{TABLE_BEGIN}\n{table()}\n{TABLE_END}"
