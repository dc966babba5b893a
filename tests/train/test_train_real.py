"""On REAL SmolLM2-135M features of ShareGPT conversations, the head learns: the training loss falls and
held-out top-1 accuracy (head argmax == the target's argmax; an argmax outside the draft vocab is a miss
for everyone) beats the frequency baseline fitted on the training split (always the most frequent
target prediction). The bigram baseline (most frequent prediction given the current token) is printed
for reference: this 60-step CPU run is around it, not clearly above it (see benchmarks/RESULTS.md)."""
import json
from collections import Counter, defaultdict

import pytest

from eaglekit.train.config import load_train_config
from eaglekit.train.trainer import build_trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # 2 OpenMP threads spin-wait on a busy 2-core box (~7x)


def _pairs(items):
    """(current token x_{t+1}, teacher argmax at t+1) at supervised positions (what head step 0 predicts)."""
    for it in items:
        ids, mask, top = it["input_ids"].tolist(), it["loss_mask"].tolist(), it["top"].tolist()
        for p in range(len(ids) - 1):
            if mask[p + 1]:
                yield ids[p], top[p]  # top = -1: outside the draft vocab, nobody can predict it


@pytest.mark.real
@pytest.mark.slow
def test_train_real_smollm2_beats_frequency_baselines(tmp_path):
    cfg = load_train_config(None, [
        # 40 conversations -> 28 with an assistant token within 160 tokens: 20 trained on (3 epochs, 60
        # steps), 8 held out (~690 positions). The cost is the target's forward over them (once, cached).
        "target=smollm2-135m-instruct", "data.conversations=sharegpt", "data.num_conversations=40",
        "data.max_length=160", "data.eval_samples=8", "data.batch_size=1", "head.draft_vocab_size=1024",
        "head.init_from_target=false", "loss.ttt_steps=1", "optim.lr=1e-3", "optim.warmup_steps=5",
        "optim.epochs=3", "eval_interval=0",
        "save_interval=0", "progress=false", "trackers=[]", f"output_dir={tmp_path}"])
    trainer = build_trainer(cfg)
    final = trainer.fit()
    curve = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in curve if "final" not in r]
    assert len(losses) >= 50
    k = len(losses) // 5
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    assert last < 0.8 * first, (first, last)

    train = [trainer.src.train[i] for i in range(len(trainer.src.train))]  # cached: no recompute
    held = [trainer.src.eval[i] for i in range(len(trainer.src.eval))]
    unigram = Counter(top for _, top in _pairs(train) if top >= 0).most_common(1)[0][0]
    table = defaultdict(Counter)
    for cur, top in _pairs(train):
        if top >= 0:
            table[cur][top] += 1
    pairs = list(_pairs(held))
    n = len(pairs)
    uni_acc = sum(top == unigram for _, top in pairs) / n
    bi_acc = sum(top == (table[cur].most_common(1)[0][0] if cur in table else unigram) for cur, top in pairs) / n
    head_acc = final["eval_acc_0"]
    print(f"loss {first:.3f} -> {last:.3f} over {len(losses)} steps; held-out top-1: head {head_acc:.3f}, "
          f"bigram {bi_acc:.3f}, unigram {uni_acc:.3f} over {n} positions")
    assert n > 500
    assert head_acc > max(2 * uni_acc, uni_acc + 0.05), (head_acc, uni_acc)
