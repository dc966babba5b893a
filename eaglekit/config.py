"""Typed run configs: a dataclass filled from YAML plus ``key=value`` overrides, validated at load time.

Every value is checked against its field's type by pydantic, and against its range where the field's
type says so (``eval_samples: NonNegInt``, ``lr: PosFloat``, ``top_p: Fraction``...); the first
problem raises one ConfigError naming the file (or "override") and the key: unknown keys, a bool that
is not true/false/yes/no/on/off/1/0 (so the string ``"false"`` is false, and ``maybe`` is refused), a
scalar where a list or a section is expected, a number out of range, NaN or infinity.

Conversions kept on purpose: YAML 1.1 reads ``1e-4`` as a string, so number fields parse strings
(``1e4`` is an int when whole); a number given for a string field becomes that string (``output_dir=2024``).
A bare string for a list field is refused rather than wrapped (``trackers=tensorboard`` → give
``trackers=[tensorboard]``): a list field may hold several values, and guessing how to split a string
would be a second syntax.

Shared sections: ``TargetSpec`` is the ``target:`` section of every job (name, dtype, device, adapter...);
a plain string there is its name (``target: smollm2-135m-instruct``, ``target=qwen...``), a section class
saying so with ``shorthand = "name"``. ``parse_dtype`` is the one reader of dtype names (configs, CLI
flags, a saved head's config.json), ``Dtype`` the names it takes.
"""
# Why dataclasses bridged to pydantic, not plain pydantic models (as vllm-project/speculators has): a
# prototype made every config class a BaseModel and dropped the mirror models below. It kept every one-line
# error and override, but saved few lines (benchmarks/RESULTS.md has the count): what is left here (overrides,
# shorthands, unknown-key hints, the errors in words) pydantic has no form of. In exchange: the config classes of seven other modules rewritten, a plain ``int`` / ``float``
# field silently taking True and refusing "1e4" (only new ``Int`` / ``Float`` types convert: a trap a
# guard test must catch), ``dataclasses.asdict`` on a config (bench) broken. Not adopted.
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union

import torch
import yaml
from pydantic import BeforeValidator, ConfigDict, Field, ValidationError, create_model

from eaglekit.assets import DEFAULT_TARGET

C = TypeVar("C")

# Field types with a range: use them in config dataclasses (plain dataclasses ignore the annotation).
NonNegInt = Annotated[int, Field(ge=0)]  # counts where 0 means none / all / off
PosInt = Annotated[int, Field(ge=1)]
NonNegFloat = Annotated[float, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]
PosFraction = Annotated[float, Field(gt=0, le=1)]  # (0, 1], e.g. top_p
Betas = Annotated[list[Annotated[float, Field(ge=0, lt=1)]], Field(min_length=2, max_length=2)]  # Adam's pair


class ConfigError(ValueError):
    """A config file or override that does not fit the config's dataclass."""


Dtype = Literal["float32", "bfloat16", "float16", "float64"]  # every dtype name eaglekit takes: a target's compute
# dtype, an export's weights (float64: for exactness checks, where fp32's summation order would show)


def parse_dtype(name: str | torch.dtype, key: str = "dtype") -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16``: every dtype name eaglekit reads goes through here. A torch.dtype
    is checked the same way (eaglekit computes in these four only); ``key`` names the setting in the error."""
    text = str(name).removeprefix("torch.") if isinstance(name, torch.dtype) else name
    if text not in typing.get_args(Dtype):
        raise ConfigError(f"{key} must be {describe(Dtype)}, got {name!r}")
    return getattr(torch, text)


@dataclasses.dataclass
class TargetSpec:
    """The ``target:`` section every job shares; a plain string is its ``name``."""
    name: str = DEFAULT_TARGET  # embedded name, model folder, Hub id or .gguf
    dtype: Dtype = "float32"  # the target's compute dtype (prepare stores features in bf16 whatever this is)
    device: str | None = None  # None: the job's own (cpu; training: each process's accelerator device);
    # "cuda" is cuda:LOCAL_RANK under a launcher
    adapter: str | None = None  # a PEFT (LoRA) adapter folder applied to the target
    merge_adapter: bool = False  # merge the adapter into the weights (else kept live)
    revision: str | None = None  # Hub revision
    trust_remote_code: bool = False
    tp_size: PosInt = 1  # > 1: split the target over each group of tp_size launched processes (torchrun /
    # accelerate launch; world = dp x tp) with transformers' tensor-parallel plan (eaglekit.target.tensor_parallel)
    device_map: str | None = None  # "auto": spread the target over GPUs, CPU and disk (offline capture; with
    max_memory: dict[str, str | int] | None = None  # per-device caps, e.g. {0: 70GiB, cpu: 200GiB}, and
    offload_folder: str | None = None  # the folder for weights placed on "disk")

    shorthand = "name"  # (not a field) ``target: NAME`` is ``target: {name: NAME}``


def parse_overrides(items: list[str], is_text=lambda key: False) -> dict:
    """``["lr=1e-4", "data.dir=x"]`` → ``{"lr": 1e-4, "data.dir": "x"}`` (values parsed as YAML scalars).

    A key for which ``is_text(key)`` holds keeps its text as given (``null`` or ``~`` is None): a prompt
    or a path may read as YAML of another type (``prompt=yes``, ``prompt=Note: x``, ``system=#1 rule``).
    """
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        key, value = item.split("=", 1)
        key = key.strip()
        if is_text(key):
            out[key] = None if value.strip() in ("null", "~") else _unquote(value)
            continue
        try:
            out[key] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: not a YAML value ({' '.join(str(e).split())})") from None
    return out


def _unquote(text: str) -> str:
    """``"a: b"`` (quoted as YAML would) → ``a: b``; any other text as given."""
    t = text.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        try:
            value = yaml.safe_load(t)
        except yaml.YAMLError:
            return text
        return value if isinstance(value, str) else text
    return text


def _is_text(cls, key: str) -> bool:
    """Is field ``key`` a string (or a string or None)? False for an unknown key."""
    try:
        hint = _hint_at(cls, key)
    except (KeyError, TypeError):
        return False
    return hint is str or (_is_union(hint) and set(typing.get_args(hint)) == {str, type(None)})


def load_config(cls: type[C], path: str | Path | None = None, overrides: list[str] | dict | None = None) -> C:
    """Build dataclass ``cls`` from a YAML file and overrides, every field validated (see the module doc).

    Nested dataclass fields are filled from nested mappings, and ``a.b=1`` overrides a nested field.
    """
    where = str(path or "config")
    data = _expand(cls, _read_yaml(Path(path))) if path is not None else {}
    ov = parse_overrides(overrides, lambda key: _is_text(cls, key)) if isinstance(overrides, list) \
        else dict(overrides or {})
    ov = dict(_override_key(cls, key, value) for key, value in ov.items())
    for key, value in ov.items():
        node = data
        *parents, leaf = key.split(".")
        for i, p in enumerate(parents):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override: cannot set {key}: {'.'.join(parents[: i + 1])} is {node!r}, "
                                  "not a section")
        node[leaf] = value
    _check_keys(cls, data, where, given=set(ov))
    try:
        model = _model(cls).model_validate(data)
    except ValidationError as e:
        key = _error_key(cls, e.errors()[0]["loc"])
        source = "override" if key in ov else where
        if not key:
            raise ConfigError(f"{where}: {e.errors()[0]['msg']}") from None
        raise ConfigError(f"{source}: {key} must be {describe(_hint_at(cls, key))}{_example(cls, key)}, "
                          f"got {_value_at(data, key)!r}") from None
    return _to_dataclass(cls, model)


# --- section shorthands: ``target: NAME`` is ``target: {name: NAME}`` --------------------------------
def _shorthand(cls, key: str) -> str | None:
    """The key a plain value of section ``key`` fills (``target`` → ``name``), else None."""
    try:
        section = _section(_hint_at(cls, key))
    except (KeyError, TypeError):
        return None
    return getattr(section, "shorthand", None) if section is not None else None


def _override_key(cls, key: str, value) -> tuple[str, object]:
    """``target=NAME`` → ``target.name``; any other override as given."""
    short = _shorthand(cls, key)
    return (f"{key}.{short}" if short is not None and not isinstance(value, dict) else key), value


def _expand(cls, data: dict) -> dict:
    """A config file's mapping with the sections given as plain values made sections."""
    out = dict(data)
    for name, value in data.items():
        section = _section(_hints(cls).get(name)) if name in _hints(cls) else None
        if isinstance(value, dict) and section is not None:
            out[name] = _expand(section, value)
        elif value is not None and getattr(section, "shorthand", None):
            out[name] = {section.shorthand: value}
    return out


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found" if not path.exists() else f"{path}: not a file")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    loaded = {} if loaded is None else loaded
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
    return loaded


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _section(hint):
    """The dataclass a field holds (``X`` or ``X | None``), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if _is_union(hint) and len(args) == 1 and dataclasses.is_dataclass(args[0]) else None


def _is_union(hint) -> bool:
    return typing.get_origin(hint) in (Union, types.UnionType)


def _check_keys(cls, data: dict, where: str, prefix: str = "", given: set = frozenset()) -> None:
    """Unknown keys anywhere in ``data``: one message with the known keys of that section, naming the
    file, or "override" when the overrides (the dotted keys ``given``) brought them all."""
    fields = _hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        hints = [m if len(unknown) == 1 else f"{m} for {k}" for k in unknown if (m := _closest(cls, k))]
        source = "override" if all(prefix + k in given for k in unknown) else where
        raise ConfigError(f"{source}{':' + prefix[:-1] if prefix else ''}: unknown key(s) {unknown} for "
                          f"{cls.__name__}{' (did you mean ' + ', '.join(hints) + '?)' if hints else ''}; "
                          f"known: {sorted(fields)}")
    for name, value in data.items():
        sub = _section(fields[name])
        if sub is not None and isinstance(value, dict):
            _check_keys(sub, value, where, f"{prefix}{name}.", given)


def _keys(cls, prefix: str = ""):
    """Every dotted key of ``cls`` and its sections."""
    for name, hint in _hints(cls).items():
        yield prefix + name
        if _section(hint) is not None:
            yield from _keys(_section(hint), f"{prefix}{name}.")


def _closest(cls, key: str) -> str | None:
    """The known key ``key`` was likely meant as: a near spelling (``lrr`` → ``lr``, ``target_dtype`` →
    ``target.dtype``), else the one key of a section with that name (``dtype`` → ``target.dtype``)."""
    keys = list(_keys(cls))
    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.8)
    same = [k for k in keys if k.rsplit(".", 1)[-1] == key]
    return near[0] if near else same[0] if len(same) == 1 else None


# --- pydantic models mirroring the dataclasses -------------------------------------------------------

def _no_bool(value):
    if isinstance(value, bool):
        raise ValueError("a bool is not a number")  # noqa: TRY004 (pydantic reports ValueError only)
    return value


def _whole_number(value):
    """``"1e4"`` (YAML 1.1 reads it as a string) → 10000; anything else is left to pydantic."""
    value = _no_bool(value)
    if isinstance(value, str):
        try:
            num = float(value)
        except ValueError:
            return value
        return int(num) if math.isfinite(num) and num == int(num) else value
    return value


def _field_type(hint):
    """``hint`` with the conversions of the module doc, nested dataclasses replaced by their models."""
    if hint is int:
        return Annotated[int, BeforeValidator(_whole_number)]
    if hint is float:
        return Annotated[float, BeforeValidator(_no_bool)]
    if dataclasses.is_dataclass(hint):  # a section left empty in YAML (``head:``) means all defaults
        return Annotated[_model(hint), BeforeValidator(lambda v: {} if v is None else v)]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return Annotated[(_field_type(args[0]), *hint.__metadata__)]
    if _is_union(hint):
        return Union[tuple(_field_type(a) for a in args)]  # noqa: UP007 (built from a tuple)
    if origin in (list, tuple, dict) and args:
        return origin[tuple(a if a is Ellipsis else _field_type(a) for a in args)]
    return hint


@functools.cache
def _model(cls):
    # defaults are never used: only the keys given are validated and passed on (see _to_dataclass)
    fields = {name: (_field_type(hint), None) for name, hint in _hints(cls).items()}
    config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)
    return create_model(f"{cls.__name__}Fields", __config__=config, **fields)


def _to_dataclass(cls, model):
    kwargs = {}
    for name in model.model_fields_set:
        value = getattr(model, name)
        sub = _section(_hints(cls)[name])
        kwargs[name] = _to_dataclass(sub, value) if sub is not None and value is not None else value
    return cls(**kwargs)


# --- error messages ----------------------------------------------------------------------------------

def _error_key(cls, loc: tuple) -> str:
    """Dotted key of a pydantic error location (list indices and union member tags dropped)."""
    parts = []
    for item in loc:
        if cls is None or not isinstance(item, str) or item not in _hints(cls):
            continue
        parts.append(item)
        cls = _section(_hints(cls)[item])
    return ".".join(parts)


def _hint_at(cls, key: str):
    hint = cls
    for part in key.split("."):
        hint = _hints(_section(hint) or hint)[part]
    return hint


def _value_at(data: dict, key: str):
    for part in key.split("."):
        data = data[part]
    return data


def _example(cls, key: str) -> str:
    """`` (e.g. [0.9, 0.95])`` from a list field's default, else ``""``."""
    *parents, leaf = key.split(".")
    owner = _section(_hint_at(cls, ".".join(parents))) if parents else cls
    field = {f.name: f for f in dataclasses.fields(owner)}[leaf]
    default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    if not isinstance(default, list) or not default:
        return ""
    return f" (e.g. {yaml.safe_dump(default, default_flow_style=True).strip()})"


def _range(meta) -> str:
    bounds = {k: getattr(m, k) for m in meta for k in ("ge", "gt", "le", "lt", "min_length", "max_length")
              if hasattr(m, k)}
    if "min_length" in bounds and bounds["min_length"] == bounds.get("max_length"):
        return f" of length {bounds['min_length']}"
    sizes = [f"{word} {bounds[k]} item{'' if bounds[k] == 1 else 's'}"
             for k, word in (("min_length", "at least"), ("max_length", "at most")) if k in bounds]
    if sizes:
        return f" ({', '.join(sizes)})"
    low = f"[{bounds['ge']}" if "ge" in bounds else f"({bounds['gt']}" if "gt" in bounds else None
    high = f"{bounds['le']}]" if "le" in bounds else f"{bounds['lt']})" if "lt" in bounds else None
    if low and high:
        return f" in {low}, {high}"
    return "".join(f" {op} {bounds[k]}" for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
                   if k in bounds)


def _plural(text: str) -> str:
    """``a float in [0, 1)`` → ``floats in [0, 1)``."""
    article, _, rest = text.partition(" ")
    if article not in ("a", "an"):
        return text
    noun, _, tail = rest.partition(" ")
    return f"{noun}s {tail}".strip()


def describe(hint) -> str:
    """What a value of type ``hint`` must be, in words: ``an int >= 0``, ``a list of floats``..."""
    if _section(hint) is not None and not _is_union(hint):
        return f"a section of keys ({', '.join(_hints(hint))})"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        meta = [m for info in hint.__metadata__ for m in getattr(info, "metadata", [info])]
        return describe(args[0]) + _range(meta)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if _is_union(hint):
        names = [describe(a) for a in args if a is not type(None)]
        text = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
        return text + (" or null" if type(None) in args else "")
    if origin in (list, tuple) or hint in (list, tuple):
        return "a list" + (f" of {_plural(describe(args[0]))}" if args and args[0] is not Any else "")
    names = {bool: "true or false", int: "an int", float: "a float", str: "a string", dict: "a mapping"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
