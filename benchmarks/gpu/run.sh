#!/usr/bin/env bash
# The device command (run from the repository root on the GPU machine); payload from benchmarks/gpu/pack.sh,
# results to $OUT. STEP=regen | train | all (default all: regenerate, train and bench in one call).
#   STEP=regen: carry .dev/b and .dev/sharegpt; brings back regenerated.jsonl.gz (.partN if split),
#               draft_vocab.safetensors, prepare.json.
#   STEP=train: carry .dev/b and .dev/regen (step 1's files copied there; REGEN_DIR= another folder);
#               trains and benches EAGLE-3, P-EAGLE and DFlash (--kinds) with the same budget each; brings
#               back head-eagle3.tar (.partN; --bring-heads), results.tar.gz, summary.json (per kind:
#               held-out acc/τ_sim, decode τ, tokens/s, speedups), data_scaling.json (the first kind's).
# The SmolLM2 GGUF is joined from its first part at $GGUF_A (copied by an earlier call from .dev/a) and
# .dev/b/gguf.b unless the asset cache already holds the converted model (a warm machine, or a CPU).
# BUDGET_S: seconds for this call (keep it under the 600 s a command may run); EXTRA_ARGS: more options of
# benchmarks/gpu/h200_run.py (e.g. "--device cpu --batch 4"); PY: the python to use.
set -euo pipefail
: "${OUT:?OUT must name the folder the results go to}"
STEP=${STEP:-all} DEV=${DEV:-.dev} PY=${PY:-python3}
export EAGLEKIT_CACHE=${EAGLEKIT_CACHE:-/root/ekc} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$EAGLEKIT_CACHE/files" "$OUT"
if [ ! -f "$EAGLEKIT_CACHE/models/smollm2-135m-instruct/.complete" ]; then
  G="$EAGLEKIT_CACHE/files/smollm2-135m-instruct.gguf"
  if [ ! -f "$G" ]; then
    cat "${GGUF_A:-/root/gguf.a}" "$DEV/b/gguf.b" > "$G.part"
    echo "$(cat "$DEV/b/gguf.sha256")  $G.part" | sha256sum -c -
    mv "$G.part" "$G"
  fi
  # the GGUF → transformers conversion needs the gguf package, carried as a wheel
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$DEV"/b/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -f "$EAGLEKIT_CACHE/files/mt-bench.jsonl" ] || cp "$DEV/b/mt-bench.jsonl" "$EAGLEKIT_CACHE/files/mt-bench.jsonl"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L 2>/dev/null || true
# shellcheck disable=SC2086  # EXTRA_ARGS is a list of options
"$PY" benchmarks/gpu/h200_run.py --step "$STEP" --out "$OUT" --budget-s "${BUDGET_S:-500}" \
    --sharegpt "$DEV/sharegpt/sharegpt.json.gz" --regen-dir "${REGEN_DIR:-$DEV/regen}" ${EXTRA_ARGS:-} \
    2>&1 | tee "$OUT/log.txt"
