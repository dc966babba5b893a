"""Exact trees on a hybrid target against the chain at the same number of verified nodes: a small random Qwen3.5
text model (3 Gated DeltaNet layers to 1 attention layer, eaglekit decodes it on the model's own cache), an EAGLE-3
head trained briefly on the target's own greedy answers to random TRAIN prompts, then greedy decoding of HELD-OUT
prompts with, for each node budget n, a chain of n nodes (TreeSpec(depth=n, top_k=1, total_tokens=n)) and EAGLE-2
trees of n nodes (TreeSpec(depth=d, top_k=k, total_tokens=n), a few depths d). Every decode is checked equal to plain
greedy decoding (exactness is the premise). A tree on the own cache is verified one batch row per root-to-leaf path
(``loop.verify_paths``): L leaves x (1 + its deepest path) positions, against a chain's 1 + n; the table shows both,
and a second table sets each tree against the shortest chain (--extra-chains adds chain-only budgets) that verifies at
least as many positions per step.

    .venv/bin/python benchmarks/bench_hybrid_trees.py [--seeds 3] [--train-steps 60] [--heldout 16] [--tokens 48] \
        [--budgets 2,3,4,6,8] [--extra-chains 5,7,10,12,16,20] [--out benchmarks/results/cpu/hybrid-trees-20261206.json]

The target is fixed (seed 0): std-0.1 matrices (a random model at the init's 0.02 settles into loops) and the lm_head
rows of --boosted tokens scaled by --boost, so its answers are mostly those tokens and which one follows depends on
the context (read through the target's features). Per seed s the head's init and its training prompts change; the
held-out prompts are the same for every seed. τ = new tokens / verify steps per prompt; the paired difference
τ_tree - τ_chain per (seed, held-out prompt) with a paired bootstrap 95% CI (--resamples, fixed seed). Step time: per
decode (draft + verify seconds) / steps, median over the decodes; one thread (torch.set_num_threads(1)), single-thread
CPU fp32 with transformers' torch fallbacks for Gated DeltaNet, so times are skewed if anything else runs on the
machine and say nothing of a GPU's costs (where a path row's positions are nearly free next to a weight read)."""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def target_model(vocab: int, hidden: int, layers: int, boosted: int, boost: float):
    """The fixed random hybrid (seed 0): 3 Gated DeltaNet layers to 1 attention layer."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4), num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=1024, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=6, bos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    model = transformers.Qwen3_5ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
        rows = torch.randperm(vocab - 7, generator=torch.Generator().manual_seed(1))[:boosted] + 7
        model.lm_head.weight[rows] *= boost
    return model


def prompts(n: int, length: int, vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(7, vocab, (1, length), generator=g) for _ in range(n)]


def train_head(t, seed: int, seqs: torch.Tensor, steps: int, lr: float, ttt: int):
    """An EAGLE-3 head fit on ``seqs`` [N, S] (prompts + the target's greedy answers): at every position the target's
    own argmax is the label of each TTT step (``ttt_unroll``), full draft vocabulary, AdamW, full batch."""
    from eaglekit.heads import HeadConfig, build_head
    from eaglekit.heads.objectives import ttt_unroll

    torch.manual_seed(seed)
    head = build_head(HeadConfig.from_target(t, kind="eagle3", draft_vocab_size=t.vocab_size, norm_before_fc=True), t)
    head.set_draft_vocab(torch.zeros(t.vocab_size, dtype=torch.long), torch.ones(t.vocab_size, dtype=torch.bool))
    head.init_from_target(t)
    with torch.no_grad():
        out = t.forward(seqs, layer_ids=head.taps)
        taps, top = out.taps, out.logits.argmax(-1)  # top[:, i]: the target's token after position i
    opt = torch.optim.AdamW([w for w in head.parameters() if w.requires_grad], lr=lr)
    head.train()
    S, losses = seqs.shape[1], []
    for _ in range(steps):
        # step k: logits at position i predict the token at i + 2 + k, the target's argmax at i + 1 + k
        loss = sum(torch.nn.functional.cross_entropy(logits[:, :S - 2 - k].flatten(0, 1), top[:, 1 + k:S - 1].flatten())
                   for k, _, logits in ttt_unroll(head, seqs, head.fuse(taps), ttt)) / ttt
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    head.eval()
    return head, losses


def tree_specs(n: int, top_k: int) -> list[tuple[int, int]]:
    """(depth, top_k) of the trees of n nodes compared with the chain: the deepest tree (depth n - 1) and about half
    as deep."""
    return sorted({(d, top_k) for d in (max(1, math.ceil(n / 2)), n - 1) if d >= 1})


class Positions:
    """Positions the verify forwards run: a path-row verify (``loop.verify_paths``) L rows x its width, a chain
    (``loop.verify``) 1 + n. Patched into the loop's module for the run, then restored."""

    def __init__(self):
        from eaglekit.decode import loop

        self.loop, self.counts = loop, []
        self._paths, self._verify = loop.verify_paths, loop.verify

    def __enter__(self):
        def paths(target, cache, root, tree, layer_ids=()):
            out, ps = self._paths(target, cache, root, tree, layer_ids)
            self.counts.append(len(ps) * (1 + max(map(len, ps))))
            return out, ps

        def verify(target, cache, roots, trees, *a, **kw):
            self.counts.append(sum(1 + len(tr) for tr in trees))
            return self._verify(target, cache, roots, trees, *a, **kw)

        self.loop.verify_paths, self.loop.verify = paths, verify
        return self

    def __exit__(self, *exc):
        self.loop.verify_paths, self.loop.verify = self._paths, self._verify


def bootstrap(diffs: list[float], resamples: int, seed: int) -> tuple[float, float]:
    d = torch.tensor(diffs, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(d), (resamples, len(d)), generator=g)
    means = d[idx].mean(1).sort().values
    return float(means[int(0.025 * resamples)]), float(means[int(0.975 * resamples) - 1])


def main() -> None:
    from helpers import tiny_tokenizer

    from eaglekit import decode
    from eaglekit.decode.drafters import TreeSpec
    from eaglekit.decode.stats import DecodeStats
    from eaglekit.target import Target

    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--boosted", type=int, default=4, help="lm_head rows scaled by --boost")
    ap.add_argument("--boost", type=float, default=30.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--train", type=int, default=64, help="training prompts per seed")
    ap.add_argument("--train-steps", type=int, default=60, help="full-batch AdamW steps")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--heldout", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--budgets", default="2,3,4,6,8")
    ap.add_argument("--extra-chains", default="5,7,10,12,16,20",
                    help="chain-only budgets, for the comparison at equal verified positions")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--resamples", type=int, default=10_000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    budgets = [int(b) for b in args.budgets.split(",")]
    extra = [int(b) for b in args.extra_chains.split(",") if b and int(b) not in budgets]
    t = Target(target_model(args.vocab, args.hidden, args.layers, args.boosted, args.boost),
               tiny_tokenizer(args.vocab), name="qwen3.5 hybrid (random)")
    assert t.own_cache, "the target should decode on its model's own cache (recurrent layers)"
    N = args.tokens

    def greedy(ids):
        return decode.generate(t, None, ids, N, eos_token_id=False).sequences[0, ids.shape[1]:].tolist()

    held = prompts(args.heldout, args.prompt_len, args.vocab, seed=10_000)
    refs = [greedy(p) for p in held]
    distinct = statistics.mean(len(set(r)) for r in refs)
    print(f"target: hidden {args.hidden}, {args.layers} layers (3 GDN : 1 attention), vocab {args.vocab}; held-out "
          f"answers: {distinct:.1f} distinct tokens of {N} on average", flush=True)

    configs = []  # (label, spec, kind, n)
    for n in budgets:
        configs.append((f"chain d{n}", TreeSpec(depth=n, top_k=1, total_tokens=n), "chain", n))
        for d, k in tree_specs(n, args.top_k):
            configs.append((f"tree d{d} k{k}", TreeSpec(depth=d, top_k=k, total_tokens=n), "tree", n))
    for n in extra:  # chains only: the chains as long as a tree's path rows (equal verified positions)
        configs.append((f"chain d{n}", TreeSpec(depth=n, top_k=1, total_tokens=n), "chain", n))
    per = {c[0] + f" n{c[3]}": {"label": c[0], "n": c[3], "kind": c[2], "spec": repr(c[1]), "tau": [],
                                "steps": 0, "tokens": 0, "positions": 0, "step_s": [], "verify_s": [],
                                "accept_depth": []}
           for c in configs}
    seeds = []
    for s in range(args.seeds):
        train = torch.cat([torch.cat([p, torch.tensor([greedy(p)])], 1)
                           for p in prompts(args.train, args.prompt_len, args.vocab, seed=1 + s)])
        tick = time.perf_counter()
        head, losses = train_head(t, s, train, args.train_steps, args.lr, args.ttt)
        seeds.append({"seed": s, "train_s": time.perf_counter() - tick, "loss_first": losses[0],
                      "loss_last": losses[-1]})
        print(f"seed {s}: head trained {args.train_steps} steps in {seeds[-1]['train_s']:.0f} s, loss "
              f"{losses[0]:.2f} -> {losses[-1]:.2f}", flush=True)
        for label, spec, kind, n in configs:
            row = per[label + f" n{n}"]
            stats = DecodeStats()
            for i, (p, ref) in enumerate(zip(held, refs)):
                with Positions() as pos:
                    out = decode.generate(t, head, p, N, eos_token_id=False, tree=spec)
                got = out.sequences[0, p.shape[1]:].tolist()
                assert got == ref, f"seed {s} {label} n{n} prompt {i}: not plain greedy's output"
                st = out.stats
                steps = len(st.accept_lengths)
                row["tau"].append(st.new_tokens / steps)
                row["steps"] += steps
                row["tokens"] += st.new_tokens
                row["positions"] += sum(pos.counts)
                row["step_s"].append((st.draft_s + st.verify_s) / steps)
                row["verify_s"].append(st.verify_s / steps)
                stats.pool(st)
            row["accept_depth"].append(stats.acceptance_per_depth)
        print(f"seed {s}: decoded ({time.perf_counter() - start:.0f} s so far); chain d{budgets[0]} tau "
              f"{statistics.mean(per[f'chain d{budgets[0]} n{budgets[0]}']['tau'][-args.heldout:]):.2f}", flush=True)

    rows = []
    print(f"\n{'n':>2} {'chain tau':>9} {'pos/step':>8} {'step ms':>7} {'vfy ms':>6} | {'tree':>10} {'tree tau':>8} "
          f"{'tree-chain [95% CI]':>24} {'pos/step':>8} {'step ms':>7} {'vfy ms':>6}")
    for n in budgets:
        chain = per[f"chain d{n} n{n}"]
        for row in per.values():
            if row["n"] != n or row["kind"] != "tree":
                continue
            diffs = [a - b for a, b in zip(row["tau"], chain["tau"])]
            lo, hi = bootstrap(diffs, args.resamples, seed=0)
            r = {"n": n, "chain_spec": chain["spec"], "tree_spec": row["spec"], "tree": row["label"],
                 "chain_tau": statistics.mean(chain["tau"]), "tree_tau": statistics.mean(row["tau"]),
                 "diff": statistics.mean(diffs), "diff_ci95": [lo, hi], "pairs": len(diffs),
                 "tree_wins": sum(d > 0 for d in diffs), "tree_loses": sum(d < 0 for d in diffs),
                 "chain_tau_pooled": chain["tokens"] / chain["steps"], "tree_tau_pooled": row["tokens"] / row["steps"],
                 "chain_positions_per_step": chain["positions"] / chain["steps"],
                 "tree_positions_per_step": row["positions"] / row["steps"],
                 "chain_step_ms": 1e3 * statistics.median(chain["step_s"]),
                 "tree_step_ms": 1e3 * statistics.median(row["step_s"]),
                 "chain_verify_ms": 1e3 * statistics.median(chain["verify_s"]),
                 "tree_verify_ms": 1e3 * statistics.median(row["verify_s"]),
                 "chain_accept_per_depth": chain["accept_depth"], "tree_accept_per_depth": row["accept_depth"]}
            r["chain_tokens_per_position"] = r["chain_tau_pooled"] / r["chain_positions_per_step"]
            r["tree_tokens_per_position"] = r["tree_tau_pooled"] / r["tree_positions_per_step"]
            rows.append(r)
            print(f"{n:>2} {r['chain_tau']:>9.3f} {r['chain_positions_per_step']:>8.2f} {r['chain_step_ms']:>7.2f} "
                  f"{r['chain_verify_ms']:>6.2f} | {row['label']:>10} {r['tree_tau']:>8.3f} "
                  f"{r['diff']:>+8.3f} [{lo:+.3f}, {hi:+.3f}] {r['tree_positions_per_step']:>8.2f} "
                  f"{r['tree_step_ms']:>7.2f} {r['tree_verify_ms']:>6.2f}")
    # at equal verified positions: each tree against the shortest chain verifying at least as many positions per step
    chains = sorted((r for r in per.values() if r["kind"] == "chain"), key=lambda r: r["n"])
    same = []
    print("\nat equal positions (the shortest chain verifying >= the tree's positions per step):")
    print(f"{'tree':>16} {'pos/step':>8} {'tree tau':>8} | {'chain':>8} {'pos/step':>8} {'chain tau':>9} "
          f"{'tree-chain [95% CI]':>24}")
    for row in per.values():
        if row["kind"] != "tree":
            continue
        pos = row["positions"] / row["steps"]
        chain = next((c for c in chains if c["positions"] / c["steps"] >= pos), None)
        if chain is None:
            print(f"{row['label'] + ' n' + str(row['n']):>16} {pos:>8.2f}: no chain as long was run")
            continue
        diffs = [a - b for a, b in zip(row["tau"], chain["tau"])]
        lo, hi = bootstrap(diffs, args.resamples, seed=0)
        r = {"tree_spec": row["spec"], "tree_positions_per_step": pos, "tree_tau": statistics.mean(row["tau"]),
             "chain_spec": chain["spec"], "chain_positions_per_step": chain["positions"] / chain["steps"],
             "chain_tau": statistics.mean(chain["tau"]), "diff": statistics.mean(diffs), "diff_ci95": [lo, hi],
             "tree_step_ms": 1e3 * statistics.median(row["step_s"]),
             "chain_step_ms": 1e3 * statistics.median(chain["step_s"])}
        same.append(r)
        print(f"{row['label'] + ' n' + str(row['n']):>16} {pos:>8.2f} {r['tree_tau']:>8.3f} | {chain['label']:>8} "
              f"{r['chain_positions_per_step']:>8.2f} {r['chain_tau']:>9.3f} {r['diff']:>+8.3f} [{lo:+.3f}, {hi:+.3f}]")
    first = per[f"chain d{budgets[0]} n{budgets[0]}"]["accept_depth"]
    print(f"chain d{budgets[0]} acceptance per depth, per seed: "
          + "; ".join(", ".join(f"{a:.2f}" for a in seed) for seed in first))
    total = time.perf_counter() - start
    print(f"total {total:.0f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "heldout_distinct_tokens": distinct, "seeds": seeds,
                                              "rows": rows, "equal_positions": same, "per_config": per, "total_s": total,
                                              "torch": torch.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
