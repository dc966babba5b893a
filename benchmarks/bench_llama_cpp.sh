#!/usr/bin/env bash
# The llama.cpp numbers of benchmarks/RESULTS.md ("llama.cpp"), in the order they were measured: a head for
# SmolLM2 trained on answers llama-server regenerated, benched in real llama-server processes on MT-bench and
# HumanEval, then on four quantisations of the target; Qwen2.5-Coder-1.5B's plain / draft model / ngram-mod.
# Needs a quiet machine (every configuration shares the 2 cores) and ~2.5 hours, most of it regeneration.
#   bash benchmarks/bench_llama_cpp.sh [RUN_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/llama-cpp}
OUT=benchmarks/results/cpu/llama-cpp
L=$(bash scripts/llama_cpp.sh)/bin
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
EK=.venv/bin/eaglekit
SMOL=$(.venv/bin/python -c 'from eaglekit import assets; print(assets.asset_file("smollm2-135m-instruct"))')

# 1. regenerate 1,600 ShareGPT first turns through llama-server (4 slots), draft vocabulary of 4,096
if [ ! -f "$RUN/data/draft_vocab.safetensors" ]; then
  "$L/llama-server" -m "$SMOL" --host 127.0.0.1 --port 8091 -np 4 -c 12288 -t 2 --no-webui > "$RUN.server.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  for _ in $(seq 120); do curl -sf http://127.0.0.1:8091/health > /dev/null && break; sleep 1; done
  $EK prepare --config configs/prepare-smollm2.yaml output_dir="$RUN/data" num_conversations=1600 max_turns=1 \
      capture=false draft_vocab_size=4096 regenerate.endpoint=http://127.0.0.1:8091/v1 \
      regenerate.max_new_tokens=256 regenerate.max_prompt_tokens=384 regenerate.concurrency=4
  kill $server; trap - EXIT
fi

# 2. train the head llama.cpp can serve (norm_before_fc, no fc_norm / norm_output)
if [ ! -f "$RUN/head/final/model.safetensors" ]; then
  OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE DS_ACCELERATOR=cpu .venv/bin/accelerate launch --cpu --num_processes 1 \
      --num_machines 1 --num_cpu_threads_per_process 2 --mixed_precision no --dynamo_backend no train_head.py \
      --config configs/smollm2-135m-eagle3-llama-cpp.yaml data.conversations="$RUN/data/regenerated.jsonl" \
      data.draft_vocab="$RUN/data/draft_vocab.safetensors" output_dir="$RUN/head"
fi

# 3. the head in llama-server on the embedded Q4_1 file, MT-bench and HumanEval
for ds in mt-bench humaneval; do
  $EK bench engine=llama.cpp target=smollm2-135m-instruct head="$RUN/head/final" gguf_type=q8_0 dataset=$ds \
      prompts=8 prompt_order=spread max_new_tokens=128 repeats=3 threads=2 out=$OUT
done

# 4. the same head on F16 (converted from the dequantised weights), Q8_0 and Q4_K_M of the same target
.venv/bin/python - "$RUN" <<'EOF'
import sys
from pathlib import Path
from eaglekit.engines import llama_cpp
from eaglekit.target import resolve
run = Path(sys.argv[1])
f16 = run / "smollm2-f16.gguf"
if not f16.exists():
    llama_cpp.convert(resolve("smollm2-135m-instruct")[0], f16, "f16")
for q in ("Q8_0", "Q4_K_M"):
    if not (run / f"smollm2-{q.lower()}.gguf").exists():
        llama_cpp.quantize(f16, run / f"smollm2-{q.lower()}.gguf", q)
EOF
for q in f16 q8_0 q4_k_m; do
  $EK bench engine=llama.cpp target=smollm2-135m-instruct target_gguf="$RUN/smollm2-$q.gguf" head="$RUN/head/final" \
      gguf_type=q8_0 dataset=mt-bench prompts=8 prompt_order=spread max_new_tokens=128 repeats=3 threads=2 \
      "sweep_n_max=[]" "sweep_p_min=[]" "ngram_types=[]" "combine_ngram=[]" out=$OUT
done

# 5. Qwen2.5-Coder-1.5B (Q4_K mix): plain, llama.cpp's draft model (the 0.5B, n_max 4) and ngram-mod
for ds in humaneval mt-bench; do
  $EK bench engine=llama.cpp target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct gamma=4 \
      dataset=$ds prompts=8 prompt_order=spread max_new_tokens=128 repeats=3 threads=2 out=$OUT
done
