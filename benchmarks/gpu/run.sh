#!/usr/bin/env bash
# The device command (run from the repository root on the GPU machine); payload from benchmarks/gpu/pack.sh.
# Needs .dev/b (second half of the SmolLM2 GGUF, ShareGPT subset, MT-bench, gguf wheel) and the first
# half at /root/gguf.a from a previous call; $OUT receives the results.
set -euo pipefail
export EAGLEKIT_CACHE=${EAGLEKIT_CACHE:-/root/ekc} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$EAGLEKIT_CACHE/files" "$OUT"
cat "${GGUF_A:-/root/gguf.a}" .dev/b/gguf.b > "$EAGLEKIT_CACHE/files/smollm2-135m-instruct.gguf"
echo "$(cat .dev/b/gguf.sha256)  $EAGLEKIT_CACHE/files/smollm2-135m-instruct.gguf" | sha256sum -c -
gunzip -c .dev/b/sharegpt.json.gz > "$EAGLEKIT_CACHE/files/sharegpt.json"
cp .dev/b/mt-bench.jsonl "$EAGLEKIT_CACHE/files/mt-bench.jsonl"
"${PY:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .dev/b/*.whl
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L || true
"${PY:-python3}" benchmarks/gpu/h200_run.py --out "$OUT" --budget-s "${BUDGET_S:-480}" ${EXTRA_ARGS:-} 2>&1 | tee "$OUT/log.txt"
