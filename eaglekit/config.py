"""Typed run configs: a dataclass filled from YAML plus ``key=value`` overrides; unknown keys are errors."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TypeVar

import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    """A config file or override that does not fit the config's dataclass."""


def parse_overrides(items: list[str]) -> dict:
    """``["lr=1e-4", "data.dir=x"]`` → ``{"lr": 1e-4, "data.dir": "x"}`` (values parsed as YAML scalars)."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        key, value = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(value) if value.strip() else ""
    return out


def load_config(cls: type[C], path: str | Path | None = None, overrides: list[str] | dict | None = None) -> C:
    """Build dataclass ``cls`` from a YAML file and overrides; unknown keys raise ConfigError.

    Nested dataclass fields are filled from nested mappings, and ``a.b=1`` overrides a nested field.
    """
    data: dict = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded
    ov = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides or {})
    for key, value in ov.items():
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return _build(cls, data, where=str(path or "config"))


def _number(value, kind, key: str, where: str):
    """YAML reads ``1e-4`` as a string (it wants ``1.0e-4``): convert str/int/float values of number fields."""
    if kind not in (float, int) or isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return value
    try:
        num = float(value)
        if kind is int and num != int(num):
            raise ValueError
        return kind(num)
    except ValueError:
        raise ConfigError(f"{where}: {key} must be a{'n int' if kind is int else ' float'}, got {value!r}") from None


def _build(cls, data: dict, where: str, prefix: str = ""):
    import typing

    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}{':' + prefix[:-1] if prefix else ''}: unknown key(s) {unknown} for {cls.__name__}; "
                          f"known: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        sub = hints.get(name)
        if dataclasses.is_dataclass(sub) and isinstance(value, dict):
            value = _build(sub, value, where, f"{prefix}{name}.")
        kwargs[name] = _number(value, hints.get(name), f"{prefix}{name}", where)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from e


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
