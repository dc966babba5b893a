"""Scale on paper: memory and disk figures for large targets, computed from their published shapes.

    .venv/bin/python benchmarks/scale_on_paper.py            # the markdown tables in docs/training.md

Nothing is downloaded: each target is its transformers config class with the shapes of its published
config.json, its parameters counted on the meta device; the EAGLE-3 head is eaglekit's own module, built on
the meta device with the head config eaglekit would derive. What is sharded at a tensor-parallel size t
follows transformers' TP plans for these models: every decoder-layer projection (attention q/k/v/o, MLP or
expert weights) and the lm_head are split t ways; the embedding and the norms are whole on every rank; and
eaglekit adds full copies of the embedding and the lm_head that the head borrows (tensor_parallel.replicate).
A t that does not divide the KV heads is refused (eaglekit.target.tensor_parallel.check_model), so it has no row.
"""
from __future__ import annotations

import torch

GB = 1e9
BF16 = 2
TAPS = 3  # EAGLE-3's default taps; the feature file also holds the last hidden state

TARGETS = {  # name: (config class, the published config's shape)
    "Llama-3.1-8B": ("LlamaConfig", {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                         "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                                         "tie_word_embeddings": False}),
    "Llama-3.1-70B": ("LlamaConfig", {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                                          "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                                          "tie_word_embeddings": False}),
    "Qwen3-235B-A22B": ("Qwen3MoeConfig", {"hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                                               "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
                                               "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                                               "vocab_size": 151936, "tie_word_embeddings": False}),
}


def meta_model(cls_name: str, shape: dict):
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, cls_name)(**shape)
    with torch.device("meta"):
        return config, AutoModelForCausalLM.from_config(config)


def split_counts(model) -> dict[str, int]:
    """Parameters by how TP places them: ``split`` (decoder projections, lm_head), ``whole`` (embedding,
    norms, routers), and the two modules a head borrows."""
    out = {"split": 0, "whole": 0, "embed": 0, "lm_head": 0}
    for name, p in model.named_parameters():
        n = p.numel()
        if name.endswith("embed_tokens.weight"):
            out["embed"] += n
            out["whole"] += n
        elif name.startswith("lm_head"):
            out["lm_head"] += n
            out["split"] += n
        elif p.dim() >= 2 and ".mlp.gate." not in name:  # projections and experts (not the router)
            out["split"] += n
        else:
            out["whole"] += n
    return out


def per_rank_gb(c: dict, tp: int) -> float:
    """bf16 weights one rank holds at TP ``tp`` (+ the borrowed full copies when split)."""
    twins = c["embed"] + c["lm_head"] if tp > 1 else 0
    return (c["split"] / tp + c["whole"] + twins) * BF16 / GB


def head_params(config, draft_vocab: int = 32000) -> int:
    """Trainable parameters of eaglekit's one-layer EAGLE-3 head for this target (built on the meta device)."""
    from eaglekit.heads import HeadConfig, head_class

    text = config
    head_cfg = HeadConfig(kind="eagle3", num_layers=1, hidden_size=text.hidden_size, target_vocab_size=text.vocab_size,
                          draft_vocab_size=draft_vocab, target_num_layers=text.num_hidden_layers,
                          aux_layer_ids=[2, text.num_hidden_layers // 2, text.num_hidden_layers - 3],
                          num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
                          head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                          intermediate_size=text.intermediate_size)
    with torch.device("meta"):
        head = head_class("eagle3")(head_cfg)
    return sum(p.numel() for p in head.parameters())


def feature_bytes_per_token(hidden: int, fp8: bool = False) -> int:
    """Offline capture on disk per token: bf16 taps (3·H) and last (H) — or fp8 with one fp32 scale per tap
    and for last — plus the int32 id and uint8 loss mask."""
    features = (TAPS + 1) * (hidden + 4) if fp8 else (TAPS * hidden + hidden) * BF16
    return features + 4 + 1


def borrowed_gb(c: dict, tied: bool) -> float:
    """bf16 bytes of what offline training reads of the target (embedding, lm_head; the norm is noise)."""
    return (c["embed"] + (0 if tied else c["lm_head"])) * BF16 / GB


def main() -> None:
    rows, heads = [], []
    for name, (cls_name, shape) in TARGETS.items():
        config, model = meta_model(cls_name, shape)
        c = split_counts(model)
        total = sum(p.numel() for p in model.parameters())
        kv = config.num_key_value_heads
        cells = [f"{per_rank_gb(c, t):.1f}" if kv % t == 0 else f"refused (KV heads {kv})" for t in (1, 2, 4, 8)]
        rows.append(f"| {name} | {total / 1e9:.2f} B | " + " | ".join(cells) + " |")
        bpt = feature_bytes_per_token(config.hidden_size)
        p = head_params(config)
        heads.append((name, bpt, p, feature_bytes_per_token(config.hidden_size, fp8=True),
                      per_rank_gb(c, 1), borrowed_gb(c, config.tie_word_embeddings)))
    print("| target | parameters | TP 1 | TP 2 | TP 4 | TP 8 |  (GB of bf16 weights per rank)")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("| target | feature bytes / token | GB per 1M tokens | head parameters | AdamW fp32, 1 rank | "
          "ZeRO-2, 8 ranks | ZeRO-3, 8 ranks |")
    print("|---|---|---|---|---|---|---|")
    for name, bpt, p, *_ in heads:
        one, z2, z3 = 16 * p / GB, (4 * p + 12 * p / 8) / GB, 16 * p / 8 / GB
        print(f"| {name} | {bpt:,} | {bpt * 1e6 / GB:.1f} | {p / 1e6:.0f} M | {one:.1f} GB | {z2:.1f} GB | {z3:.1f} GB |")
    print()
    print("| target | fp8 feature bytes / token | GB per 1M tokens | offline training per process, whole target + "
          "head (DDP) | target's embedding + lm_head only + head |")
    print("|---|---|---|---|---|")
    for name, _, p, bpt8, whole, borrowed in heads:
        head = 16 * p / GB
        print(f"| {name} | {bpt8:,} | {bpt8 * 1e6 / GB:.1f} | {whole + head:.1f} GB | {borrowed + head:.1f} GB |")


if __name__ == "__main__":
    main()
