#!/usr/bin/env bash
# Build the payload benchmarks/gpu/run.sh needs on a GPU machine that reaches no network and accepts at
# most 64 MiB per transfer: .dev/a = first 60 MB of the SmolLM2 GGUF (send first, copy to /root/gguf.a),
# .dev/b = the rest + sha256, the first 8,000 ShareGPT conversations (first exchange only, gzipped),
# MT-bench and the gguf wheel. Run from the repository root after `bash scripts/setup.sh`.
set -euo pipefail
PY=${PY:-.venv/bin/python}
G=$("$PY" -c "from eaglekit import assets; print(assets.asset_file('smollm2-135m-instruct'))")
grep -qx '/.dev/' .git/info/exclude || echo '/.dev/' >> .git/info/exclude
rm -rf .dev && mkdir -p .dev/a .dev/b
head -c 60000000 "$G" > .dev/a/gguf.a
tail -c +60000001 "$G" > .dev/b/gguf.b
sha256sum "$G" | cut -d' ' -f1 > .dev/b/gguf.sha256
cp "$("$PY" -c "from eaglekit import assets; print(assets.asset_file('mt-bench'))")" .dev/b/mt-bench.jsonl
"$PY" -m pip download -q --no-deps gguf==0.19.0 -d .dev/b
"$PY" - <<'PYEOF'
import gzip, json
from eaglekit import assets
from eaglekit.data_prep.conversations import normalise_messages
back = {"user": "human", "assistant": "gpt", "system": "system"}
sub = [{"id": c.get("id"), "conversations": [{"from": back[m["role"]], "value": m["content"]}
                                             for m in normalise_messages(c.get("conversations", []))[:2]]}
       for c in assets.sharegpt_items()[:8000]]
with gzip.open(".dev/b/sharegpt.json.gz", "wt") as fh:
    json.dump(sub, fh)
PYEOF
du -sh .dev/a .dev/b
