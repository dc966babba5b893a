"""Share a head on the Hugging Face Hub: stage a layout + model card, then create_repo + upload_folder.

Nothing goes over the network until the head is read back from the staged files, its weights are
finite and it matches its target (fingerprint), and a token is known. The token is handed to
huggingface_hub only (argument, ``HF_TOKEN`` or its saved login); nothing here prints or logs it.
``HF_ENDPOINT`` is read at call time, so a local mirror (or a test server) works.

``push_head``, and the method ``DraftHead.push_to_hub`` (given to the class here) that calls it.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import yaml
from huggingface_hub import HfApi, constants, get_token

from eaglekit.export.formats import check_finite_head, export_head, load_head
from eaglekit.export.verifier import default_verifier, resolve_verifier
from eaglekit.heads.base import DraftHead
from eaglekit.heads.config import HeadConfig, check_target
from eaglekit.heads.io import CONFIG, WEIGHTS, save_head, target_name_of
from eaglekit.heads.registry import head_class
from eaglekit.target import Target, load_target

log = logging.getLogger(__name__)

RESULTS_FILE = "results.json"  # optional, beside the head: {"tau", "speedup", "benchmark", "device", ...}
LAYOUT_CHOICES = ("native", "sglang", "vllm", "speculators", "eagle1")
NO_TOKEN = "no Hugging Face token: set HF_TOKEN or run `hf auth login`"


class PushError(RuntimeError):
    """A push that cannot start (no token) or whose connection to the Hub failed."""


def base_model_of(config: HeadConfig) -> str:
    """The head's target as a model card names it: its Hub id where one is known."""
    return default_verifier(config.target_name) or config.target_name


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
    cls = head_class(config.kind)  # the kind names itself and says how engines serve it
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
             f"taps (layer inputs) {config.aux_layer_ids}" if cls.reads == "taps"
             else "predicts the target's next last-layer feature; uses the target's lm_head")
    if cls.parallel:
        vocab += f"; drafts {cls.tokens_per_draft(config)} tokens in one forward (block of {config.block_size})"
    engines = _serving_section(layout, repo_id, base, cls, config)
    body = f"""# {cls.display_name} draft head for {base}

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
from eaglekit.export import load_head
from eaglekit import decode

target = load_target("{config.target_name or base}")
head = load_head("{repo_id}", target)  # refuses a target it was not trained for
out = decode.generate(target, head, input_ids, max_new_tokens=256, temperature=0.0)
```

{engines}"""
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n\n" + body


def _serving_section(layout: str, repo_id: str, base: str, cls, config: HeadConfig) -> str:
    """How to serve the uploaded layout, for the engines that read it (docs/exports.md): the head class
    ``cls`` gives vLLM's method (None: vLLM reads it from the export), its extra options and SGLang's
    algorithm (None: no SGLang loader); a parallel head drafts its block, an EAGLE head a chain of 3."""
    spec = {**({"method": cls.vllm_method} if cls.vllm_method else {}), "model": repo_id,
            "num_speculative_tokens": cls.tokens_per_draft(config) if cls.parallel else 3,
            **(cls.vllm_options if cls.parallel else {})}
    vllm = f"""### vLLM

```bash
vllm serve {base} --speculative-config '{json.dumps(spec)}'
```
"""
    tree = "" if cls.parallel else (" --speculative-num-steps 3 \\\n  --speculative-eagle-topk 4 "
                                    "--speculative-num-draft-tokens 16")
    sglang = f"""### SGLang

```bash
python -m sglang.launch_server --model {base} --speculative-algorithm {cls.sglang_algorithm} \\
  --speculative-draft-model-path {repo_id}{tree}
```
"""
    if layout == "vllm":
        return vllm
    if layout == "sglang":
        return sglang
    if layout == "speculators":
        served = vllm + f"""
The config names the verifier (`{base}`), so `vllm serve {repo_id}` also works.
""" if getattr(cls, "vllm_serves", True) else f"""### llama.cpp

```bash
eaglekit export --head {repo_id} --out {config.kind}-gguf --to llama.cpp
llama-server -m TARGET.gguf -md {config.kind}-gguf/head-f16.gguf --spec-type {cls.llama_cpp_spec_type}
```
"""
        return served + f"""
### speculators

```python
from {cls.speculators_model[0]} import {cls.speculators_model[1]}
draft = {cls.speculators_model[1]}.from_pretrained("{repo_id}")
```
"""
    if layout == "eagle1":
        return f"""### SafeAILab/EAGLE

```python
from eagle.model.ea_model import EaModel
model = EaModel.from_pretrained(base_model_path="{base}", ea_model_path="{repo_id}", use_eagle3=False)
```
"""
    return f"""### vLLM / SGLang

This upload is eaglekit's native layout. Export it for an engine first:
`eaglekit export --head {repo_id} --out exported --to vllm` (or `--to sglang` / `--to speculators` / `--to eagle1`).
"""


def stage(head_or_dir, out_dir, layout: str = "native", target=None, repo_id: str = "user/head",
          datasets=(), base_model: str | None = None, verifier: str | None = None) -> list[str]:
    """Write the files to upload into ``out_dir`` (layout + README.md), read back and checked; returns
    their names. A folder is checked against ``target`` (default: the target its config names)."""
    if layout not in LAYOUT_CHOICES:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUT_CHOICES)}")
    out, src = Path(out_dir), None
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(head_or_dir, (str, Path)):
        src = Path(head_or_dir)
        target = target if target is not None else load_head_target(src)
        if layout == "native":  # the bytes uploaded are the bytes checked: copy first, then load the copy
            for name in (CONFIG, WEIGHTS):
                shutil.copyfile(src / name, out / name)
            config = _load_staged(out, src, target).config
        else:
            head = load_head(src, target)
            config = head.config
    else:
        head, config = head_or_dir, head_or_dir.config
        check_finite_head(head, where="push")
        if target is not None:  # a module was checked when bound; check again against the target given
            check_target(config, target, where="push")
        if layout == "native":
            save_head(head, out)
    base = resolve_verifier(verifier or base_model, config.target_name, hub_only=True)
    if layout != "native":
        archs = list(getattr(getattr(target, "config", None), "architectures", None) or [])
        export_head(head, out, layout, verifier_architectures=archs, overwrite=True, verifier=base)
    card = model_card(config, repo_id, layout, base, datasets, read_results(src))
    (out / "README.md").write_text(card)
    return sorted(p.name for p in out.iterdir())


def _load_staged(staged: Path, src: Path, target):
    """load_head on the staged copy; its errors name the user's folder, not the temporary one."""
    try:
        return load_head(staged, target)
    except (ValueError, OSError) as e:
        try:
            renamed = type(e)(str(e).replace(str(staged), str(src)))
        except TypeError:  # an exception class that takes other arguments: keep the original
            raise e from None
        raise renamed from e


def load_head_target(head_dir) -> Target:
    """The target a saved head (native or export folder) names, loaded."""
    name = target_name_of(head_dir)
    if not name:
        raise ValueError(f"{head_dir}: the head names no target; pass --target (Python: target=)")
    return load_target(name)


def hub_token(token: str | None = None) -> str:
    """The token to upload with: the argument, else HF_TOKEN / the saved `hf auth login`."""
    token = token or get_token()
    if not token:
        raise PushError(NO_TOKEN)
    return token


def _is_connection_error(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}  # httpx / requests, whichever huggingface_hub uses
    return isinstance(e, ConnectionError) or bool(names & {"ConnectError", "ConnectionError", "ConnectTimeout",
                                                           "NetworkError", "TransportError"})


def push_head(head_or_dir, repo_id: str, private: bool = False, token: str | None = None, layout: str = "native",
                target=None, datasets=(), base_model: str | None = None, dry_run: bool = False,
                commit_message: str = "Upload EAGLE draft head (eaglekit)", endpoint: str | None = None,
                verifier: str | None = None) -> dict:
    """Upload a head (module or saved folder) with its model card; ``dry_run`` only stages it.

    Before any request: a token is known, the staged files are read back (finite weights, the head
    matches its target) and the verifier is a Hub id. Returns ``{"repo_id", "files", "card", "url"}``
    (url is None in a dry run).
    """
    if not dry_run:
        token = hub_token(token)
    with tempfile.TemporaryDirectory(prefix="eaglekit-push-") as tmp:
        files = stage(head_or_dir, tmp, layout, target, repo_id, datasets, base_model, verifier)
        card = (Path(tmp) / "README.md").read_text()
        if dry_run:
            return {"repo_id": repo_id, "files": files, "card": card, "url": None}
        url = endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
        api = HfApi(endpoint=url)
        try:
            repo = api.create_repo(repo_id, private=private, exist_ok=True, token=token)
            log.info("uploading %d files to %s", len(files), repo_id)
            commit = api.upload_folder(repo_id=repo_id, folder_path=tmp, commit_message=commit_message,
                                       token=token)
        except Exception as e:
            if _is_connection_error(e):
                raise PushError(f"cannot reach the Hugging Face Hub at {url}: {e} (set HF_ENDPOINT for a "
                                "mirror)") from e
            raise
        return {"repo_id": repo_id, "files": files, "card": card, "url": str(getattr(commit, "commit_url", repo))}


def _push_to_hub(self: DraftHead, repo_id: str, private: bool = False, token: str | None = None, **kw) -> dict:
    """``head.push_to_hub(repo_id)``: upload this head (``layout="native"`` or an export layout) with a
    model card; see ``export.hub.push_head``."""
    return push_head(self, repo_id, private=private, token=token, **kw)


DraftHead.push_to_hub = _push_to_hub
