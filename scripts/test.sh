#!/usr/bin/env bash
# The test suite: set up (first time only), then pytest. Real-model tests (marker `real`) use the
# asset cache; `bash scripts/test.sh -m "not real"` runs the fast unit tests alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q --durations=30 "$@"
