"""Share a head on the Hugging Face Hub: stage a layout + model card, then create_repo + upload_folder.

The token is handed to huggingface_hub only (argument, ``HF_TOKEN`` or its saved login); nothing here
prints or logs it. ``HF_ENDPOINT`` is read at call time, so a local mirror (or a test server) works.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import yaml

from eaglekit.heads.config import EAGLE1, HeadConfig

log = logging.getLogger(__name__)

# eaglekit's embedded targets are GGUF conversions of these Hub models
KNOWN_BASE_MODELS = {
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "qwen2.5-coder-0.5b-instruct": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    "qwen2.5-coder-1.5b-instruct": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
}
RESULTS_FILE = "results.json"  # optional, beside the head: {"tau", "speedup", "benchmark", "device", ...}
LAYOUT_CHOICES = ("native", "sglang", "vllm", "speculators", "eagle1")


def base_model_of(config: HeadConfig) -> str:
    return KNOWN_BASE_MODELS.get(config.target_name, config.target_name)


def read_results(head_dir) -> dict:
    """What is known about a head's quality, from files beside it.

    ``results.json`` in the head folder (measured decoding: ``tau`` or ``acceptance_length``, ``speedup``,
    ``benchmark``, ``device``) and the trainer's ``metrics.json`` (in the folder or its parent:
    ``eval_tau_sim``, the simulated acceptance length on held-out data).
    """
    if not head_dir:
        return {}
    head_dir, out = Path(head_dir), {}
    for f in (head_dir.parent / "metrics.json", head_dir / "metrics.json", head_dir / RESULTS_FILE):
        if f.is_file():
            try:
                out.update(json.loads(f.read_text()))
            except json.JSONDecodeError as e:
                raise ValueError(f"{f}: not valid JSON ({e})") from e
    if "tau" not in out and "acceptance_length" in out:
        out["tau"] = out["acceptance_length"]
    return out


def card_metadata(config: HeadConfig, base_model: str, datasets=(), results: dict | None = None) -> dict:
    results = results or {}
    meta = {
        "base_model": base_model,
        "library_name": "eaglekit",
        "tags": ["eaglekit", "speculative-decoding", config.kind, "draft-model"],
        "datasets": list(datasets),
    }
    if results.get("tau") is not None:
        meta["acceptance_length"] = float(results["tau"])
    if results.get("speedup") is not None:
        meta["speedup"] = float(results["speedup"])
    if results.get("eval_tau_sim") is not None:
        meta["simulated_acceptance_length"] = round(float(results["eval_tau_sim"]), 3)
    return meta


def model_card(config: HeadConfig, repo_id: str, layout: str, base_model: str | None = None, datasets=(),
               results: dict | None = None) -> str:
    """README.md: YAML metadata (base_model, tags, datasets, measured τ/speedup) + how to run the head."""
    base = base_model or base_model_of(config)
    results = results or {}
    meta = card_metadata(config, base, datasets, results)
    name = "EAGLE-3" if config.kind != EAGLE1 else "EAGLE-1"
    method, algo = ("eagle", "EAGLE") if config.kind == EAGLE1 else ("eagle3", "EAGLE3")
    if results.get("tau") is not None or results.get("speedup") is not None:
        measured = (f"| acceptance length τ | speedup | benchmark | device |\n|---|---|---|---|\n"
                    f"| {results.get('tau', 'n/a')} | {results.get('speedup', 'n/a')} | "
                    f"{results.get('benchmark', '')} | {results.get('device', '')} |")
    else:
        measured = "Not measured yet (no results.json beside the head)."
    if results.get("eval_tau_sim") is not None:
        measured += (f"\n\nSimulated acceptance length on held-out training data (from per-step accuracy, "
                     f"not a decoding run): {float(results['eval_tau_sim']):.2f}.")
    vocab = (f"draft vocabulary {config.draft_vocab_size} of {config.target_vocab_size} target tokens, "
             f"taps (layer inputs) {config.aux_layer_ids}" if config.kind != EAGLE1
             else "predicts the target's next last-layer feature; uses the target's lm_head")
    engines = (f"""### vLLM

```bash
vllm serve {base} --speculative-config '{{"method": "{method}", "model": "{repo_id}", "num_speculative_tokens": 3}}'
```

### SGLang

```bash
python -m sglang.launch_server --model {base} --speculative-algorithm {algo} \\
  --speculative-draft-model-path {repo_id} --speculative-num-steps 3 \\
  --speculative-eagle-topk 4 --speculative-num-draft-tokens 16
```
""" if layout != "native" else f"""### vLLM / SGLang

This upload is eaglekit's native layout. Export it for the engines first:
`eaglekit export --head {repo_id} --out exported --to sglang` (or `--to speculators` / `--to eagle1`).
""")
    body = f"""# {name} draft head for {base}

A speculative-decoding draft head trained with [eaglekit](https://github.com/) for `{base}`
({config.num_layers} decoder layer(s), hidden size {config.hidden_size}; {vocab}).
Layout: `{layout}`. Target fingerprint (config + tokenizer): `{config.target_fingerprint}`.
Drafting is lossless: the target verifies every drafted token.

## Measured

{measured}

## Use

### eaglekit

```python
from eaglekit.target import load_target
from eaglekit.heads import load_head
from eaglekit import decode

target = load_target("{config.target_name or base}")
head = load_head("{repo_id}", target)  # refuses a target it was not trained for
out = decode.generate(target, head, input_ids, max_new_tokens=256, temperature=0.0)
```

{engines}"""
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n\n" + body


def stage(head_or_dir, out_dir, layout: str = "native", target=None, repo_id: str = "user/head",
          datasets=(), base_model: str | None = None) -> list[str]:
    """Write the files to upload into ``out_dir`` (layout + README.md); returns their names."""
    from eaglekit.heads.export import export_head
    from eaglekit.heads.io import CONFIG, WEIGHTS, load_head, native_config, read_config

    if layout not in LAYOUT_CHOICES:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUT_CHOICES)}")
    out, src = Path(out_dir), None
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(head_or_dir, (str, Path)):
        src = Path(head_or_dir)
        if layout == "native":
            config = native_config(read_config(src), where=str(src / CONFIG))
            for name in (CONFIG, WEIGHTS):
                shutil.copyfile(src / name, out / name)
        else:
            if target is None:
                raise ValueError(f"exporting {src} as {layout} needs the target (to check and bind the head)")
            head = load_head(src, target)
            config = head.config
            archs = list(getattr(target.config, "architectures", None) or [])
            export_head(head, out, layout, verifier_architectures=archs, overwrite=True)
    else:
        head, config = head_or_dir, head_or_dir.config
        head.save_pretrained(out) if layout == "native" else export_head(head, out, layout, overwrite=True)
    card = model_card(config, repo_id, layout, base_model, datasets, read_results(src))
    (out / "README.md").write_text(card)
    return sorted(p.name for p in out.iterdir())


def push_to_hub(head_or_dir, repo_id: str, private: bool = False, token: str | None = None, layout: str = "native",
                target=None, datasets=(), base_model: str | None = None, dry_run: bool = False,
                commit_message: str = "Upload EAGLE draft head (eaglekit)", endpoint: str | None = None) -> dict:
    """Upload a head (module or saved folder) with its model card; ``dry_run`` only stages it.

    Returns ``{"repo_id", "files", "card", "url"}`` (url is None in a dry run).
    """
    with tempfile.TemporaryDirectory(prefix="eaglekit-push-") as tmp:
        files = stage(head_or_dir, tmp, layout, target, repo_id, datasets, base_model)
        card = (Path(tmp) / "README.md").read_text()
        if dry_run:
            return {"repo_id": repo_id, "files": files, "card": card, "url": None}
        from huggingface_hub import HfApi

        api = HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT") or None)
        repo = api.create_repo(repo_id, private=private, exist_ok=True, token=token)
        log.info("uploading %d files to %s", len(files), repo_id)
        commit = api.upload_folder(repo_id=repo_id, folder_path=tmp, commit_message=commit_message, token=token)
        return {"repo_id": repo_id, "files": files, "card": card, "url": str(getattr(commit, "commit_url", repo))}
