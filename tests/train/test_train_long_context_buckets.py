"""benchmarks/bench_long_context.py's per-position split: its counts, summed over the position buckets, are
training's held-out per-step counts for the same batch (so a bucket shows a share of the very metric the
trainer reports), and a position lands in the bucket its edges say."""
import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import tiny_target

from eaglekit.heads import HeadConfig, build_head
from eaglekit.heads.objectives import Teacher, ttt_loss
from eaglekit.train.config import LossConfig

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_long_context", ROOT / "benchmarks" / "bench_long_context.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_bucket_counts_add_up_to_the_trainers_eval_counts():
    target = tiny_target(vocab_size=64, hidden=32, layers=6)
    torch.manual_seed(0)
    head = build_head(HeadConfig.from_target(target, kind="eagle3", num_layers=1, draft_vocab_size=48), target)
    teacher = Teacher.build(target.lm_head.weight, head.t2d)
    ids = torch.randint(7, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.ones_like(ids)
    loss_mask[0, :9] = 0  # a prompt
    out = target.features(ids, layer_ids=head.taps)
    batch = {"input_ids": ids, "loss_mask": loss_mask, "taps": out.taps, "last": out.last}
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(15):  # fit the batch a little: a head that gets some positions right, not all
        opt.zero_grad()
        ttt_loss(head, teacher, batch, LossConfig(ttt_steps=3), steps=3)[0].backward()
        opt.step()
    _, stats = ttt_loss(head, teacher, batch, LossConfig(ttt_steps=3), steps=3, train=False)
    per_step = bench.score_positions(head, teacher, batch, 3)
    rows = bench.summarise([per_step], [16, 30], 3)
    for k in range(3):
        mine = [r for r in rows if r["step"] == k]
        assert [r["bucket"] for r in mine] == ["<16", "16-30", ">=30"]
        assert sum(r["positions"] for r in mine) == stats.total[k]
        assert round(sum(r["acc"] * r["positions"] for r in mine)) == stats.correct[k]
    assert 0 < sum(stats.correct) < sum(stats.total)  # neither all right nor all wrong: the sums can differ
    assert per_step[0][0].min() == 9 and per_step[2][0].max() == 39  # predicted positions: first supervised, last


def test_bucket_edges():
    where = torch.tensor([0, 511, 512, 2047, 2048, 4000])
    assert bench.bucket_of(where, [512, 2048]).tolist() == [0, 0, 1, 1, 2, 2]
