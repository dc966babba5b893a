"""Held-out top-1 accuracy of a saved head split by position in the sequence: does a head trained on short
sequences still draft well past them?

Scores ``--head`` (a saved head folder, e.g. ``<run>/final``, or a trainer checkpoint ``<run>/checkpoints/
step-N``) on long ShareGPT conversations the run did not train on (those after the first ``--skip``, as
``data.num_conversations`` takes the first N; multi-turn, tokenized up to ``--max-length``, kept when at
least ``--min-tokens`` long). Each conversation's features come from one target forward; the head is
unrolled ``--ttt`` steps exactly as in training's held-out evaluation (no noise), and each supervised
prediction is filed under the bucket of the position of the token it predicts (``--buckets`` edges,
default <512, 512-2k, >=2k). Accuracy = head argmax == target argmax over the full vocabulary (a target
token outside the draft vocabulary counts as a miss), per TTT step and bucket, and its difference from
the first bucket; the 95% intervals resample whole conversations (positions in one conversation are not
independent; the difference is paired: the same resampled conversations in both buckets).

    python benchmarks/bench_long_context.py --head runs/x/final --samples 8 --out long.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from eaglekit.bench.report import paired_bootstrap

BOOTSTRAP = 2000


def load_any_head(path: Path, target):
    """A saved head folder (``load_head``) or a trainer checkpoint (its config and ``model.safetensors``)."""
    from eaglekit.export import load_head

    if not (path / "train_config.json").exists():
        return load_head(path, target, dtype=torch.float32)
    from eaglekit.heads import HeadConfig
    from eaglekit.heads.io import instantiate, read_weights

    h = json.loads((path / "train_config.json").read_text())["head"]
    state = read_weights(path / "model.safetensors")
    vd = state["d2t"].numel() if "d2t" in state else None
    cfg = HeadConfig.from_target(target, kind=h["kind"], num_layers=h["num_layers"], draft_vocab_size=vd,
                                 aux_layer_ids=h.get("aux_layer_ids"), block_size=h.get("block_size") or None,
                                 fc_norm=h.get("fc_norm", False), norm_output=h.get("norm_output", False),
                                 norm_before_fc=h.get("norm_before_fc", False))
    return instantiate(cfg, state, target, torch.float32, None, path / "model.safetensors")


def long_samples(tokenizer, skip: int, count: int, min_tokens: int, max_length: int) -> list[dict]:
    """The first ``count`` conversations after the first ``skip`` that tokenize to >= ``min_tokens``."""
    from eaglekit.data_prep import load_sharegpt
    from eaglekit.data_prep.template import tokenize_conversation

    convs = list(load_sharegpt())
    seen = {base_id(c["id"]) for c in convs[:skip]}  # ShareGPT splits a chat into parts id_0, id_1, ...
    out = []
    for conv in convs[skip:]:
        if len(conv["messages"]) < 3 or sum(len(m["content"]) for m in conv["messages"]) < 3 * min_tokens:
            continue  # too short to reach min_tokens (~3+ characters per token): skip the tokenizer
        if base_id(conv["id"]) in seen:
            continue  # a part of a chat trained on, or of one already picked
        s = tokenize_conversation(tokenizer, conv["messages"], max_length, report_empty=False)
        if len(s["input_ids"]) >= min_tokens and s["loss_mask"][min_tokens // 2:].any():
            out.append({"id": conv["id"], **s})
            seen.add(base_id(conv["id"]))
            if len(out) == count:
                break
    if len(out) < count:
        raise SystemExit(f"only {len(out)} ShareGPT conversations after the first {skip} reach {min_tokens} tokens")
    return out


def base_id(conv_id: str) -> str:
    return conv_id.rsplit("_", 1)[0]


def features(target, sample: dict, kind: str, taps: list[int], cache: Path | None) -> dict:
    """One conversation's training item (a target forward), kept under ``cache`` for the next head scored."""
    from eaglekit.data_prep.capture import compute_features
    from eaglekit.fileio import write_safetensors

    name = f"{sample['id']}-{len(sample['input_ids'])}-{kind}-{'_'.join(map(str, taps))}.safetensors"
    if cache is not None and (cache / name).exists():
        from safetensors.torch import load_file
        return load_file(cache / name)
    item = compute_features(target, [sample], kind, taps or None)[0]
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        write_safetensors(cache / name, {k: v.contiguous() for k, v in item.items() if torch.is_tensor(v)})
    return item


@torch.no_grad()
def score_positions(head, teacher, batch: dict, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per TTT step k: (positions of the predicted tokens, right or not) at the supervised positions."""
    from eaglekit.heads.layers import shift_left
    from eaglekit.heads.objectives import ttt_unroll

    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    top = teacher.targets(batch["last"], 512)
    g = head.training_features(batch, 0.0)
    out = []
    for k, _, logits in ttt_unroll(head, ids, g, steps):
        valid = shift_left(loss_mask, 2 + k).bool()[0]  # element t predicts x_{t+2+k}
        right = (logits.argmax(-1) == shift_left(top, 1 + k, fill=-1))[0]
        where = torch.arange(ids.shape[1]) + 2 + k
        out.append((where[valid], right[valid]))
    return out


def bucket_of(where: torch.Tensor, edges: list[int]) -> torch.Tensor:
    return torch.bucketize(where, torch.tensor(edges), right=True)


def summarise(per_conv: list, edges: list[int], steps: int, seed: int = 0) -> list[dict]:
    """Rows (bucket, step): accuracy pooled over conversations and its conversation-bootstrap 95% interval."""
    names = [f"<{edges[0]}"] + [f"{a}-{b}" for a, b in itertools.pairwise(edges)] + [f">={edges[-1]}"]
    rows = []
    for k in range(steps):
        # right[c, b], total[c, b]: conversation c, bucket b
        right = torch.zeros(len(per_conv), len(names))
        total = torch.zeros(len(per_conv), len(names))
        for c, steps_out in enumerate(per_conv):
            where, ok = steps_out[k]
            b = bucket_of(where, edges)
            total[c].index_add_(0, b, torch.ones_like(where, dtype=torch.float))
            right[c].index_add_(0, b, ok.float())

        def acc_of(idx, b, right=right, total=total):  # bucket b's accuracy pooled over conversations idx
            return float(right[idx, b].sum() / total[idx, b].sum().clamp(min=1))

        def ci95(stat):  # seeded alike: every bucket's resamples are the same conversations
            return list(paired_bootstrap(stat, len(per_conv), BOOTSTRAP, seed)[1:])

        acc = right.sum(0) / total.sum(0).clamp(min=1)
        for b, name in enumerate(names):
            n = int(total[:, b].sum())
            ci = ci95(lambda idx, b=b: acc_of(idx, b)) if n else [float("nan")] * 2
            # paired with the first bucket: the same resampled conversations, so content differences cancel
            diff = ci95(lambda idx, b=b: acc_of(idx, b) - acc_of(idx, 0)) if n and b else [0.0, 0.0]
            rows.append({"step": k, "bucket": name, "positions": n, "conversations": int((total[:, b] > 0).sum()),
                         "acc": float(acc[b]), "ci95": ci, "minus_first": float(acc[b] - acc[0]),
                         "minus_first_ci95": diff})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, required=True, help="saved head folder or trainer checkpoint step-N")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--skip", type=int, default=1000, help="conversations the run may have trained on (first N)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--min-tokens", type=int, default=3072)
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--buckets", nargs="+", type=int, default=[512, 2048])
    ap.add_argument("--features-cache", type=Path, help="keep each conversation's target features here")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    from eaglekit.heads.objectives import Teacher
    from eaglekit.target import load_target
    from eaglekit.train.data import collate

    t0 = time.perf_counter()
    target = load_target(a.target)
    head = load_any_head(a.head, target).eval()
    teacher = Teacher.build(target.lm_head.weight, getattr(head, "t2d", None) if head.has_draft_vocab else None)
    samples = long_samples(target.tokenizer, a.skip, a.samples, a.min_tokens, a.max_length)
    per_conv = []
    for i, s in enumerate(samples):
        item = features(target, s, head.config.kind, list(head.taps), a.features_cache)
        per_conv.append(score_positions(head, teacher, collate([item], head.reads), a.ttt))
        print(f"[{i + 1}/{len(samples)}] {s['id']}: {len(s['input_ids'])} tokens, "
              f"{int(s['loss_mask'].sum())} supervised ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = summarise(per_conv, a.buckets, a.ttt)
    print("| position bucket | " + " | ".join(f"step {k}" for k in range(a.ttt)) + " | positions (step 0) |")
    print("|---" * (a.ttt + 2) + "|")
    for name in dict.fromkeys(r["bucket"] for r in rows):
        cells = [r for r in rows if r["bucket"] == name]
        print(f"| {name} | " + " | ".join(
            f"{r['acc']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]; {r['minus_first']:+.3f} "
            f"[{r['minus_first_ci95'][0]:+.3f}, {r['minus_first_ci95'][1]:+.3f}]" for r in cells)
              + f" | {cells[0]['positions']} |")
    if a.out:
        from eaglekit.fileio import write_json
        write_json(a.out, {"head": str(a.head), "samples": [s["id"] for s in samples],
                           "lengths": [len(s["input_ids"]) for s in samples], "args": {
                               k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                           "rows": rows, "seconds": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
