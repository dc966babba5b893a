#!/usr/bin/env bash
# Build what benchmarks/gpu/run.sh needs on a GPU machine that reaches no network and takes at most 64 MiB
# per call (the repository included). Run from the repository root after `bash scripts/setup.sh`:
#   .dev/a          the first 60 MB of the SmolLM2 GGUF (one call of its own: copy it to /root/gguf.a)
#   .dev/b          the rest of the GGUF + its sha256, MT-bench, the gguf wheel (every step carries it)
#   .dev/sharegpt   sharegpt.json.gz: the first N=12000 valid ShareGPT conversations, each cut to its first
#                   MAX_TURNS=2 user turns (step 1 and STEP=all carry it)
# Step 2 carries .dev/regen instead: make it and copy step 1's files into it (docs/benchmarks.md).
set -euo pipefail
PY=${PY:-.venv/bin/python} N=${N:-12000} MAX_TURNS=${MAX_TURNS:-2}
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.dev/' "$EXCLUDE" 2>/dev/null || echo '/.dev/' >> "$EXCLUDE"  # never in a commit or a plain call
G=$("$PY" -c "from eaglekit import assets; print(assets.asset_file('smollm2-135m-instruct'))")
rm -rf .dev/a .dev/b .dev/sharegpt && mkdir -p .dev/a .dev/b .dev/sharegpt
head -c 60000000 "$G" > .dev/a/gguf.a
tail -c +60000001 "$G" > .dev/b/gguf.b
sha256sum "$G" | cut -d' ' -f1 > .dev/b/gguf.sha256
cp "$("$PY" -c "from eaglekit import assets; print(assets.asset_file('mt-bench'))")" .dev/b/mt-bench.jsonl
"$PY" -m pip download -q --no-deps gguf==0.19.0 -d .dev/b
"$PY" benchmarks/gpu/gpu_io.py sharegpt-subset --n "$N" --max-turns "$MAX_TURNS" --out .dev/sharegpt/sharegpt.json.gz
du -sh .dev/a .dev/b .dev/sharegpt
