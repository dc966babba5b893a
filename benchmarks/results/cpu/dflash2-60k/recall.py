"""Held-out top-16 candidate recall (teacher argmax within the unary top-16) per block depth, per sample, for
bench_recipes heads; paired bootstrap of dflash2 - dflash over held-out samples (seeds averaged)."""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/
import bench_recipes as br

from eaglekit.heads.objectives import TTTModel
from eaglekit.train.build import assemble
from eaglekit.train.config import load_train_config
from eaglekit.train.data import collate, fetch_with_top, tensors_to

ap = argparse.ArgumentParser()
ap.add_argument("--features")
ap.add_argument("--out")
ap.add_argument("--arms", nargs="+")
ap.add_argument("--seeds", nargs="+", type=int)
ap.add_argument("--set", nargs="*", default=[])
ap.add_argument("--ttt", type=int, default=3)
ap.add_argument("--eval-samples", type=int, default=24)
a = ap.parse_args()
a.bf16 = False
res = {}
for arm in a.arms:
    for seed in a.seeds:
        head_dir = Path(a.out) / f"{arm}-s{seed}" / "final"
        cfg = load_train_config(br.CONFIG, [*br.common(a), *br.ARMS[arm], f"head.init_from={head_dir}", "eval_only=true",
                                            f"output_dir={head_dir.parent / 'eval_recall'}"])
        parts = assemble(cfg)
        head, rec, rows = parts.head, {}, []
        picks0, stats0 = head.block_picks, head._stats

        def picks(hidden, prev, logits, picks0=picks0, rec=rec):
            rec["top"] = logits.topk(16, -1).indices
            return picks0(hidden, prev, logits)

        def stats(p, want, valid, per_depth, stats0=stats0, rec=rec):
            rec["hit"] = int(((rec["top"] == want[..., None]).any(-1) & valid).sum())
            rec["n"] = int(valid.sum())
            return stats0(p, want, valid, per_depth)

        head.block_picks, head._stats = picks, stats
        model = TTTModel(head, parts.teacher, cfg.loss).eval()
        with torch.no_grad():
            for i in range(len(parts.sources.eval)):
                items = fetch_with_top(parts.sources.eval, [i], parts.teacher, cfg.loss.chunk_tokens, parts.acc.device)
                model(**tensors_to(collate(items, head.reads), parts.acc.device), steps=a.ttt, train=False)
                rows.append((rec["hit"], rec["n"]))
        parts.lock.release()
        res.setdefault(arm, {})[seed] = rows
        print(arm, seed, sum(h for h, _ in rows) / sum(n for _, n in rows), flush=True)


def recall(arm, idx):
    return sum(sum(res[arm][s][i][0] for i in idx) / max(1, sum(res[arm][s][i][1] for i in idx)) for s in a.seeds) / len(a.seeds)


n = len(next(iter(res[a.arms[0]].values())))
full = list(range(n))
diff = recall(a.arms[1], full) - recall(a.arms[0], full)
g = torch.Generator().manual_seed(0)
boot = sorted(recall(a.arms[1], idx) - recall(a.arms[0], idx)
              for idx in torch.randint(0, n, (2000, n), generator=g).tolist())
out = {arm: recall(arm, full) for arm in a.arms} | {"diff": diff, "ci95": [boot[50], boot[1949]]}
print(json.dumps(out))
(Path(a.out) / "recall.json").write_text(json.dumps(out, indent=1))
