from dataclasses import dataclass, field

import pytest

from eaglekit.config import ConfigError, load_config


@dataclass
class Inner:
    lr: float = 0.1
    steps: int = 1


@dataclass
class Outer:
    name: str = "x"
    inner: Inner = field(default_factory=Inner)


def test_yaml_and_overrides_fill_nested_fields(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: run\ninner:\n  lr: 1e-4\n")  # YAML 1.1 reads 1e-4 as a string
    cfg = load_config(Outer, path, ["inner.steps=3"])
    assert cfg == Outer("run", Inner(1e-4, 3)) and isinstance(cfg.inner.lr, float)


def test_unknown_and_bad_keys_are_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("inner:\n  lrr: 1\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:inner: unknown key\(s\) \['lrr'\]"):
        load_config(Outer, path)
    with pytest.raises(ConfigError, match="inner.steps must be an int, got 2.5"):
        load_config(Outer, None, ["inner.steps=2.5"])
    with pytest.raises(ConfigError, match="inner.lr must be a float, got 'fast'"):
        load_config(Outer, None, ["inner.lr=fast"])
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(Outer, None, ["name"])
