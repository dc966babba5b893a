#!/usr/bin/env bash
# The longer CPU recipe (a few hours on 2 cores): regenerate N ShareGPT first turns with SmolLM2, train an
# EAGLE-3 and an EAGLE-1 head on the same data, bench both on MT-bench (all 8 categories, T=0 and T=1,
# median of 3 repeats). Every step resumes: rerun after an interruption.  N=1000 RUN=runs/long by default;
# DATA=<dir> reuses a prepare output (regenerated.jsonl + draft_vocab.safetensors, e.g. regenerated on a GPU)
# and trains on its first N conversations; TRAIN_SET / BENCH_SET add key=value overrides (e.g. a smoke run:
# N=8 TRAIN_SET="optim.epochs=1 data.eval_samples=2").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
RUN=${RUN:-runs/long} N=${N:-1000}
DATA=${DATA:-$RUN/data}
[ -f "$DATA/regenerated.jsonl" ] && [ -f "$DATA/draft_vocab.safetensors" ] ||
.venv/bin/eaglekit prepare --config configs/prepare-smollm2.yaml output_dir="$DATA" num_conversations="$N" \
    max_turns=1 capture=false draft_vocab_size=8192 regenerate.enabled=true regenerate.max_new_tokens=256 \
    regenerate.max_prompt_tokens=512 regenerate.batch_size=16
for kind in eagle3 eagle1; do
  .venv/bin/accelerate launch --cpu --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
      train_head.py --config "configs/smollm2-135m-$kind-long.yaml" data.conversations="$DATA/regenerated.jsonl" \
      data.num_conversations="$N" data.draft_vocab="$DATA/draft_vocab.safetensors" output_dir="$RUN/$kind" ${TRAIN_SET:-}
done
for kind in eagle3 eagle1; do
  .venv/bin/eaglekit bench target=smollm2-135m-instruct head="$RUN/$kind/final" prompts=16 prompt_order=spread \
      max_new_tokens=128 repeats=3 lookup_tokens=2,5,10 out="$RUN/bench-$kind" ${BENCH_SET:-}
done
