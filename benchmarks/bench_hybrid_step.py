"""What a recurrent target's state handling adds to a drafted step: a Qwen3.5-shaped hybrid (3 Gated DeltaNet
layers to 1 attention layer) against an attention-only Qwen3 of the same widths and depth, both random, the same
chain drafter (the target's own argmax continuation, one node wrong, so every step rolls back), side by side in one
run: plain decoding's token time, a drafted step's time (verify with the state recorded, then the crop), and the
state a row keeps.

    .venv/bin/python benchmarks/bench_hybrid_step.py [--hidden 256] [--layers 8] [--depth 4] [--tokens 48] [--repeats 5]

Medians over repeats; one thread (OMP) unless --threads. fp32 (transformers' torch fallbacks for Gated DeltaNet:
no fla / causal-conv1d kernels on a CPU)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def models(hidden: int, layers: int, vocab: int):
    import transformers

    common = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers,
              "num_attention_heads": hidden // 64, "num_key_value_heads": max(1, hidden // 256), "head_dim": 64,
              "max_position_embeddings": 4096, "tie_word_embeddings": False}
    hybrid = transformers.Qwen3_5TextConfig(**common, linear_num_key_heads=hidden // 128,
                                            linear_num_value_heads=hidden // 64, linear_key_head_dim=64,
                                            linear_value_head_dim=64,
                                            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4))
    dense = transformers.Qwen3Config(**common)
    out = {}
    for name, cfg, cls in (("qwen3.5 hybrid", hybrid, transformers.Qwen3_5ForCausalLM),
                           ("qwen3 attention", dense, transformers.Qwen3ForCausalLM)):
        torch.manual_seed(0)
        out[name] = cls(cfg).eval()
    return out


class WrongAtChain:
    """The target's own greedy continuation ``depth`` tokens deep, the last one wrong: every step verifies
    ``depth`` nodes, keeps depth - 1 and rolls one back. Its own cost (greedy forwards) is not timed."""

    layer_ids = None

    def __init__(self, target, depth):
        self.t, self.depth, self.drafting_s = target, depth, 0.0

    def prefill(self, prompt, out, root):
        self.ctx = prompt[0].tolist() + [root]

    def commit(self, tree, path, next_token, out, rows):
        self.ctx += tree.path_tokens(path) + [next_token]

    @torch.no_grad()
    def draft(self, max_depth):
        from eaglekit.decode.drafters import Tree

        start, ctx, tokens = time.perf_counter(), list(self.ctx), []
        for _ in range(min(self.depth, max_depth)):
            tokens.append(int(self.t.model(torch.tensor([ctx])).logits[0, -1].argmax()))
            ctx.append(tokens[-1])
        if tokens:
            tokens[-1] = (tokens[-1] + 1) % self.t.vocab_size
        self.drafting_s += time.perf_counter() - start
        return Tree.chain(torch.tensor(tokens, dtype=torch.long), torch.ones(len(tokens)))


def state_bytes(cache) -> dict:
    """Bytes a row keeps: recurrent + convolution states (fixed), keys and values (per token)."""
    fixed = kv = 0
    for layer in cache.layers:
        for d in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            fixed += sum(t.numel() * t.element_size() for t in d.values() if isinstance(t, torch.Tensor))
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                kv += t.numel() * t.element_size()
    return {"fixed_bytes": fixed, "kv_bytes": kv}


def main() -> None:
    from helpers import tiny_tokenizer

    from eaglekit import decode
    from eaglekit.target import Target

    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompt = torch.randint(3, args.vocab, (1, 64), generator=torch.Generator().manual_seed(0))
    rows = {}
    for name, model in models(args.hidden, args.layers, args.vocab).items():
        t = Target(model, tiny_tokenizer(args.vocab), name=name)
        plain, drafted, steps = [], [], []
        for _ in range(args.repeats):
            out = decode.generate(t, None, prompt, args.tokens, eos_token_id=False)
            plain.append(out.stats.verify_s / len(out.stats.accept_lengths))
            chain = WrongAtChain(t, args.depth)
            out = decode.generate(t, chain, prompt, args.tokens, eos_token_id=False)
            drafted.append(out.stats.verify_s / len(out.stats.accept_lengths))
            steps.append(out.stats.tau)
        cache = t.model(input_ids=prompt, use_cache=True).past_key_values
        rows[name] = {"plain_step_ms": 1e3 * statistics.median(plain),
                      "drafted_step_ms": 1e3 * statistics.median(drafted), "tau": statistics.median(steps),
                      **state_bytes(cache), "own_cache": t.own_cache}
        r = rows[name]
        r["drafted_over_plain"] = r["drafted_step_ms"] / r["plain_step_ms"]
        print(f"{name:18s} plain step {r['plain_step_ms']:7.2f} ms  drafted step ({args.depth} nodes, one rolled back) "
              f"{r['drafted_step_ms']:7.2f} ms = {r['drafted_over_plain']:.2f}x  tau {r['tau']:.2f}  "
              f"state/row {r['fixed_bytes'] / 2**10:.0f} KiB fixed + {r['kv_bytes'] / prompt.shape[1] / 2**10:.1f} KiB "
              "per token", flush=True)
    h, a = rows["qwen3.5 hybrid"], rows["qwen3 attention"]
    print(f"hybrid / attention: drafted step {h['drafted_step_ms'] / a['drafted_step_ms']:.2f}x, plain step "
          f"{h['plain_step_ms'] / a['plain_step_ms']:.2f}x; the drafted step's premium over plain "
          f"{h['drafted_over_plain']:.2f}x vs {a['drafted_over_plain']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
