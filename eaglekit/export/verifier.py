"""The verifier (target) id an export or a model card names: something an engine can actually load.

Engines load the verifier by name: speculators from ``speculators_config.verifier.name_or_path``, vLLM
from the same field when serving a speculators folder, model cards as ``base_model``. eaglekit's own
target names are often neither (the embedded alias ``smollm2-135m-instruct``, a tiny test model), so
the id is resolved here and anything else is refused before a file is written.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from eaglekit import assets

# huggingface_hub's repo-id rule: ORG/NAME, letters, digits, '.', '_', '-', no '--' or '..', <= 96 each
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def is_hub_id(name: str) -> bool:
    name = str(name)
    return bool(_HUB_ID.match(name)) and ".." not in name and "--" not in name and not name.endswith(".git")


def check_verifier(name: str, hub_only: bool = False) -> str:
    """``name`` as it will be written: a Hub repo id unchanged, an existing local model folder as an
    absolute path (unless ``hub_only``). Anything else raises ValueError."""
    name = str(name).strip()
    p = Path(name).expanduser()
    if not hub_only and p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"verifier {name!r}: {p} has no config.json, so no engine can load it as a model")
        return str(p.resolve())
    if is_hub_id(name):
        return name
    where = "a Hugging Face repo id (ORG/NAME)" if hub_only else \
        "a Hugging Face repo id (ORG/NAME) nor an existing local model folder"
    raise ValueError(f"verifier {name!r} is not {where}; an engine could not load it. "
                     "Pass the target's id with --verifier ORG/NAME")


def default_verifier(target_name: str) -> str | None:
    """The verifier id for a head trained on ``target_name``, or None when it cannot be told.

    An embedded asset -> its original Hub repo; a local model folder -> the Hub id its config.json
    records in ``_name_or_path``, else the folder itself; a Hub id -> itself.
    """
    name = str(target_name or "").strip()
    if not name:
        return None
    asset = assets.ASSETS.get(name)
    if asset is not None:
        return asset.hub_id or None
    p = Path(name).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        try:
            recorded = json.loads((p / "config.json").read_text()).get("_name_or_path", "")
        except (json.JSONDecodeError, OSError, AttributeError):
            recorded = ""
        return recorded if is_hub_id(recorded) else str(p.resolve())
    return name if is_hub_id(name) and not p.exists() else None


def resolve_verifier(given: str | None, target_name: str, hub_only: bool = False, required: bool = True):
    """``given`` checked, else the default for ``target_name``; None only when not ``required``."""
    if given:
        return check_verifier(given, hub_only=hub_only)
    found = default_verifier(target_name)
    if found is not None and (not hub_only or is_hub_id(found)):
        return found
    if not required:
        return None
    what = "a Hugging Face repo id" if hub_only else "a Hugging Face repo id or a local model folder"
    raise ValueError(f"the head's target {target_name!r} is not {what} that engines can load as the "
                     "verifier; pass it with --verifier ORG/NAME")
