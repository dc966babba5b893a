#!/usr/bin/env bash
# The main job: set up (first time only), then run it on the embedded default target.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
# OpenMP threads wait asleep, not spinning, at barriers: beside other work a spinning thread holds the core
# its preempted peer needs (eaglekit/timing.py); set before Python starts, so the decode phase has it too
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec .venv/bin/eaglekit demo "$@"
