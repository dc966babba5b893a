#!/usr/bin/env bash
# The test suite: set up (first time only), ruff, then pytest. Real-model tests (marker `real`) use the
# asset cache; `bash scripts/test.sh -m "not real"` runs the fast unit tests alone.
set -euo pipefail
cd "$(dirname "$0")/.."
# the whole suite (no arguments: how CI runs it) has setup start its real-server engines in the background
if [ $# -eq 0 ]; then bash scripts/setup.sh --engines-in-background; else bash scripts/setup.sh; fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check --quiet . || { echo "ruff check failed (fix the findings above: \`.venv/bin/ruff check .\`)"; exit 1; }
# 2 workers: each test runs on one thread (tests/conftest.py), so one process alone leaves a core idle
exec .venv/bin/python -m pytest -q -n "${EAGLEKIT_TEST_WORKERS:-2}" --dist loadgroup --durations=30 "$@"
