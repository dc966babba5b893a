"""The architecture matrix: a tiny random model of each architecture eaglekit supports (built from
transformers' own config classes, no downloads), the recurrent ones it refuses, and the docs/inputs.md table both
produce (scripts/arch_table.py writes it, tests/target/test_model_architectures.py checks it).

Every tiny model: 2 layers, hidden 64, vocabulary 512. Sliding windows are WINDOW tokens, shorter than the
test prompts, so every sliding layer runs past its window.
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

# models whose recurrent state cannot drop rejected draft tokens: refused before any work
REFUSED = {
    "mamba": Arch("MambaConfig", "MambaForCausalLM", "Mamba", "state-space layers", {"state_size": 4}),
    "jamba": Arch("JambaConfig", "JambaForCausalLM", "Jamba", "Mamba + attention layers",
                  {"attn_layer_period": 2, "attn_layer_offset": 1, "num_experts": 2, "expert_layer_period": 2,
                   "mamba_d_state": 4, "mamba_dt_rank": 8}),
    "qwen3_next": Arch("Qwen3NextConfig", "Qwen3NextForCausalLM", "Qwen3-Next",
                       "linear attention + attention",
                       {"layer_types": ["linear_attention", "full_attention"], "head_dim": 16, "num_experts": 4,
                        **MOE}),
    "lfm2": Arch("Lfm2Config", "Lfm2ForCausalLM", "LFM2", "short convolutions + attention",
                 {"layer_types": ["conv", "full_attention"]}),
    "falcon_h1": Arch("FalconH1Config", "FalconH1ForCausalLM", "Falcon-H1", "Mamba and attention in each layer",
                      {"mamba_d_state": 4, "mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16,
                       "mamba_n_groups": 1, "head_dim": 16}),
}


def config(arch: Arch):
    import transformers

    return getattr(transformers, arch.config)(**{**BASE, **arch.kw})


def tiny_model(name: str, seed: int = 0):
    """The matrix's tiny random ``name`` model, fp32, with the attention backend load_target would pick."""
    from transformers import AutoModelForCausalLM

    from eaglekit.target.architectures import attention_implementation

    cfg = config(MATRIX[name])
    attn = attention_implementation(AutoModelForCausalLM._model_mapping[type(cfg)])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn).eval()


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
    for a in REFUSED.values():
        rows.append([f"`{a.model_class}`", a.examples, a.features, "refused (recurrent state)"] + ["—"] * 2)
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def readme_block() -> str:
    return f"{TABLE_BEGIN}\n{table()}\n{TABLE_END}"
