#!/usr/bin/env bash
# The main job: set up (first time only), then run it on the embedded default target.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/eaglekit demo "$@"
