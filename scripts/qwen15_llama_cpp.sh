#!/usr/bin/env bash
# An EAGLE-3 head for Qwen2.5-Coder-1.5B-Instruct that llama-server drafts with, on a CPU, end to end. Every
# step resumes (rerun after an interruption), and a new machine starts from the committed answers:
#   1. answers: ShareGPT first turns (HumanEval and MT-bench are not in it) answered by the target itself
#      through llama-server (the embedded Q4_K file, $SLOTS slots); data/qwen15-answers.jsonl.gz seeds the run and
#      is rewritten (gzip) with what this run added, so committing it carries the work to the next machine
#   2. train: online features from the bf16 target (native bf16 on AMX / avx512_bf16 CPUs; set
#      target.dtype=float32 elsewhere in TRAIN_SET), resuming the last checkpoint; INIT=<head folder> starts a
#      new run from an earlier head (head.init_from) when the data grew
#   3. export q8_0, then `eaglekit bench engine=llama.cpp` on 8 HumanEval and 8 MT-bench prompts
#   STEPS="answers train bench" N=1200 RUN=runs/qwen15-llama-cpp THREADS=2 bash scripts/qwen15_llama_cpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_WAIT_POLICY=PASSIVE
STEPS=${STEPS:-answers train bench} N=${N:-1200} RUN=${RUN:-runs/qwen15-llama-cpp} THREADS=${THREADS:-2}
# 16 slots: on 2 cores a batch of 16 decodes in ~2.9x the time of one (llama-batched-bench), 4 in ~1.5x
SLOTS=${SLOTS:-16}
DATA=$RUN/data SEED=data/qwen15-answers.jsonl.gz
EK=.venv/bin/eaglekit
L=$(.venv/bin/python -m eaglekit.engines.llama_cpp)/bin
gguf() { .venv/bin/python -c "from eaglekit import assets; print(assets.asset_file('$1'))"; }
mkdir -p "$DATA"

if [[ " $STEPS " == *" answers "* ]]; then
  if [ -f "$SEED" ] && [ ! -s "$DATA/regenerated.jsonl" ]; then gzip -dc "$SEED" > "$DATA/regenerated.jsonl"; fi
  "$L/llama-server" -m "$(gguf qwen2.5-coder-1.5b-instruct)" --host 127.0.0.1 --port 8092 -np "$SLOTS" -c $((SLOTS * 1408)) \
      -t "$THREADS" --no-webui > "$RUN/answers-server.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  for _ in $(seq 120); do curl -sf http://127.0.0.1:8092/health > /dev/null && break; sleep 1; done
  $EK prepare --config configs/prepare-qwen2.5-coder-1.5b-llama-cpp.yaml output_dir="$DATA" num_conversations="$N" \
      regenerate.endpoint=http://127.0.0.1:8092/v1 \
      regenerate.concurrency="$SLOTS" regenerate.batch_size="$SLOTS" || true  # an interrupted run keeps its whole windows
  kill $server; trap - EXIT
  mkdir -p "$(dirname "$SEED")"
  gzip -9c "$DATA/regenerated.jsonl" > "$SEED.tmp" && mv "$SEED.tmp" "$SEED"
  [ -f "$DATA/draft_vocab.safetensors" ] || { echo "answers: not all $N yet; rerun to go on"; exit 1; }
fi

if [[ " $STEPS " == *" train "* ]]; then
  .venv/bin/accelerate launch --cpu --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
      train_head.py --config configs/qwen2.5-coder-1.5b-eagle3-llama-cpp.yaml output_dir="$RUN/head" \
      data.conversations="$DATA/regenerated.jsonl" data.draft_vocab="$DATA/draft_vocab.safetensors" \
      ${INIT:+head.init_from=$INIT} ${TRAIN_SET:-}
fi

if [[ " $STEPS " == *" bench "* ]]; then
  for set in humaneval mt-bench; do
    $EK bench engine=llama.cpp target=qwen2.5-coder-1.5b-instruct head="$RUN/head/final" gguf_type=q8_0 \
        draft=qwen2.5-coder-0.5b-instruct dataset=$set prompts=8 prompt_order=spread max_new_tokens=96 \
        repeats=3 threads="$THREADS" out="$RUN/bench-$set" ${BENCH_SET:-}
  done
fi
