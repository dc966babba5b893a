#!/usr/bin/env bash
# The vLLM numbers of benchmarks/RESULTS.md ("vLLM CPU backend"): one small head of every kind eaglekit
# exports for vLLM, trained here on 200 ShareGPT conversations (1 epoch of the shipped SmolLM2 configs: small heads, the
# point is what vLLM serves of them), then
# served by real `vllm serve` processes (vLLM's CPU backend, scripts/vllm_cpu.sh) beside plain vLLM on 8
# MT-bench first turns: greedy outputs compared, vLLM's acceptance length beside eaglekit's τ.
# Needs a quiet machine; ~35 min on 2 cores.
#   bash benchmarks/bench_vllm.sh [RUN_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/vllm}
bash scripts/vllm_cpu.sh > /dev/null
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
train() {  # name config overrides...
  local name=$1 config=$2; shift 2
  [ -f "$RUN/$name/final/model.safetensors" ] || .venv/bin/python train_head.py --config "configs/$config.yaml" \
      output_dir="$RUN/$name" data.num_conversations=200 optim.epochs=1 optim.bf16=false eval_interval=0 save_interval=0 progress=false "$@"
}
train eagle3 smollm2-135m-eagle3 head.fc_norm=false head.norm_output=false
train eagle31 smollm2-135m-eagle3
train norm-before-fc smollm2-135m-eagle3 head.fc_norm=false head.norm_output=false head.norm_before_fc=true
train peagle smollm2-135m-peagle
train dflash smollm2-135m-dflash head.draft_vocab_size=49152
train dflash-dv smollm2-135m-dflash
heads=$(printf '%s/final,' "$RUN"/{eagle3,eagle31,norm-before-fc,peagle,dflash,dflash-dv})
.venv/bin/eaglekit bench engine=vllm target=smollm2-135m-instruct "heads=[${heads%,}]" dataset=mt-bench \
    prompts=8 prompt_order=spread max_new_tokens=128 repeats=3 threads=2 out=benchmarks/results/cpu/vllm
