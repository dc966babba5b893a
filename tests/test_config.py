import re
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


@pytest.mark.parametrize("override,message", [
    ("optim.bf16=maybe", "override: optim.bf16 must be true or false, got 'maybe'"),
    ("optim.betas=0.9", (r"override: optim.betas must be a list of floats in \[0, 1\) of length 2 "
                        r"\(e.g. \[0.9, 0.95\]\), got 0.9")),
    ("optim.betas=[0.9]", r"optim.betas must be a list .* of length 2 .*, got \[0.9\]"),
    ("optim.betas=[0.9, 1.5]", r"optim.betas must be a list of floats in \[0, 1\)"),
    ("head=5", r"override: head must be a section of keys \(kind, num_layers, .*\), got 5"),
    ("data.eval_samples=-5", "override: data.eval_samples must be an int >= 0, got -5"),
    ("trackers=tensorboard", (r"override: trackers must be a list of strings \(e.g. \[tensorboard\]\), "
                             "got 'tensorboard'")),
    ("save_interval=-1", "override: save_interval must be an int >= 0, got -1"),
    ("optim.lr=-0.5", "optim.lr must be a float >= 0, got -0.5"),
    ("optim.lr=true", "optim.lr must be a float >= 0, got True"),
    ("optim.lr=.inf", "optim.lr must be a float >= 0, got inf"),
    ("optim.warmup_ratio=1.5", r"optim.warmup_ratio must be a float in \[0, 1\], got 1.5"),
    ("data.batch_size=2.5", "data.batch_size must be an int >= 1, got 2.5"),
    ("optim.grad_clip=0", "optim.grad_clip must be a float > 0, got 0"),
    ("head.aux_layer_ids=[1, x]", r"head.aux_layer_ids must be a list of ints >= 0 or null, got \[1, 'x'\]"),
])
def test_train_config_fields_checked_by_type_and_range(override, message):
    from eaglekit.train.config import load_train_config

    with pytest.raises(ConfigError, match=message):
        load_train_config(None, ["data.conversations=x", override])


def test_yaml_values_are_checked_naming_file_and_key(tmp_path):
    from eaglekit.train.config import load_train_config

    path = tmp_path / "run.yaml"
    path.write_text('data:\n  conversations: x\noptim:\n  bf16: "false"\n  max_steps: 1e4\nhead:\noutput_dir: 2024\n')
    cfg = load_train_config(path)  # a quoted "false" is false; an empty section keeps its defaults
    assert cfg.optim.bf16 is False and cfg.optim.max_steps == 10_000 and cfg.head.kind == "eagle3"
    assert cfg.output_dir == "2024" and cfg.optim.betas == [0.9, 0.95]
    path.write_text("data:\n  conversations: [a, b]\n")
    with pytest.raises(ConfigError, match=rf"^{path}: data.conversations must be a string or null, got \['a', 'b'\]$"):
        load_train_config(path)
    path.write_text("data:\n  conversations: x\noptim:\n  bf16: maybe\n")
    with pytest.raises(ConfigError, match=rf"^{path}: optim.bf16 must be true or false, got 'maybe'$"):
        load_train_config(path)
    with pytest.raises(ConfigError, match="override: cannot set head.kind: head is 5, not a section"):
        load_train_config(path, ["head=5", "head.kind=eagle1"])
    path.write_text("data: [1\n")
    with pytest.raises(ConfigError, match=rf"^{path}: not valid YAML"):
        load_train_config(path)
    path.write_bytes(b"target: caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"^{path}: not UTF-8 text"):
        load_train_config(path)


def test_every_config_dataclass_is_checked():
    """Each CLI's config refuses a bad value naming the key (the types alone, no hand-written check)."""
    from eaglekit.bench.cli import BenchConfig
    from eaglekit.data_prep.prepare import PrepareConfig
    from eaglekit.decode.cli import GenerateConfig
    from eaglekit.export.cli import ExportOptions
    from eaglekit.export.push_cli import PushOptions

    cases = [(PrepareConfig, "regenerate.enabled=maybe", "regenerate.enabled must be true or false"),
             (PrepareConfig, "layer_ids=3", "layer_ids must be a list of ints"),
             (PrepareConfig, "max_length=0", "max_length must be an int >= 1, got 0"),
             (PrepareConfig, "regenerate.top_p=0", r"regenerate.top_p must be a float in \(0, 1\], got 0"),
             (PrepareConfig, "regenerate.concurrency=0", "regenerate.concurrency must be an int >= 1"),
             (GenerateConfig, "max_new_tokens=-1", "max_new_tokens must be an int >= 1"),
             (GenerateConfig, "top_p=2", r"top_p must be a float in \(0, 1\]"),
             (BenchConfig, "temperatures=0.5", "temperatures must be a list"),
             (ExportOptions, "overwrite=maybe", "overwrite must be true or false"),
             (ExportOptions, "speculative_tokens=0", "speculative_tokens must be an int >= 1"),
             (PushOptions, "datasets=sharegpt", "datasets must be a list of strings")]
    for cls, override, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(cls, None, [override])


def test_text_fields_keep_override_text_as_given():
    """A prompt or path that reads as YAML of another type (a bool, a mapping, a comment) stays text."""
    from eaglekit.decode.cli import GenerateConfig

    cfg = load_config(GenerateConfig, None, ["prompt=yes", "system=Rule #1: be brief", "head=null",
                                             'draft="quoted: text"', "max_new_tokens=3"])
    assert (cfg.prompt, cfg.system, cfg.head, cfg.draft) == ("yes", "Rule #1: be brief", None, "quoted: text")
    assert cfg.max_new_tokens == 3
    assert load_config(Outer, None, ["name=2024"]).name == "2024"


# ---- the shared target section ---------------------------------------------------------------------------
def test_target_section_nested_or_as_a_name(tmp_path):
    """``target:`` is a section (name, dtype, device...); a plain name fills its ``name``."""
    from eaglekit.assets import DEFAULT_TARGET
    from eaglekit.config import TargetSpec
    from eaglekit.train.config import load_train_config

    nested, short = tmp_path / "nested.yaml", tmp_path / "short.yaml"
    nested.write_text("target:\n  name: some/model\n  dtype: bfloat16\ndata:\n  conversations: x\n")
    short.write_text("target: some/model\ndata:\n  conversations: x\n")
    assert load_train_config(nested).target == TargetSpec(name="some/model", dtype="bfloat16")
    assert load_train_config(short).target == TargetSpec(name="some/model")
    assert load_train_config(None, ["data.conversations=x"]).target == TargetSpec(name=DEFAULT_TARGET)
    # an override of the name keeps the rest of the section
    cfg = load_train_config(nested, ["target=other", "target.dtype=float16"])
    assert cfg.target == TargetSpec(name="other", dtype="float16")
    assert load_train_config(nested, ["target.name=third"]).target.dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"override: target.dtype must be one of 'float32', "
                                          r"'bfloat16', 'float16', 'float64', got 'int8'"):
        load_train_config(nested, ["target.dtype=int8"])
    with pytest.raises(ConfigError, match=r"target: unknown key\(s\) \['dtyp'\] for TargetSpec \(did you mean dtype\?\)"):
        load_train_config(None, ["data.conversations=x", "target.dtyp=float16"])
    with pytest.raises(ConfigError, match="leave target.device unset"):
        load_train_config(None, ["data.conversations=x", "target.device=cuda"])


def test_flat_target_keys_are_unknown_and_point_at_the_section(tmp_path):
    """No older flat keys (a 0.1.0 package has no old callers): ``target_dtype`` (train), ``dtype`` and
    ``device`` (prepare) are refused, the error naming the key in the target section."""
    from eaglekit.data_prep.prepare import PrepareConfig
    from eaglekit.train.config import load_train_config

    flat = tmp_path / "flat.yaml"
    flat.write_text("target: some/model\ntarget_dtype: bfloat16\ndata:\n  conversations: x\n")
    with pytest.raises(ConfigError, match=rf"^{flat}: unknown key\(s\) \['target_dtype'\] for TrainConfig "
                                          r"\(did you mean target.dtype\?\); known: \["):
        load_train_config(flat)
    with pytest.raises(ConfigError, match=r"^override: unknown key\(s\) \['device', 'dtype'\] for PrepareConfig \(did you "
                                          r"mean target.device for device, target.dtype for dtype\?\)"):
        load_config(PrepareConfig, None, ["device=cpu", "dtype=float16"])
    with pytest.raises(ConfigError, match=r"^override: unknown key\(s\) \['warmup'\] for TrainConfig; known"):
        load_train_config(None, ["data.conversations=x", "warmup=3"])  # no near key, none of that name
    with pytest.raises(ConfigError, match=r"^override:optim: unknown key\(s\) \['lrr'\] for OptimConfig \(did you "
                                          r"mean lr\?\)"):
        load_train_config(None, ["data.conversations=x", "optim.lrr=3"])


def test_parse_dtype_is_the_one_reader_of_dtype_names():
    import torch

    from eaglekit.config import parse_dtype

    assert parse_dtype("bfloat16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    assert parse_dtype("float64") is torch.float64 and parse_dtype(torch.half) is torch.float16
    # names torch has but eaglekit does not compute in, and names torch lacks, each naming the key
    for bad in ("float8_e4m3fn", "half", "int64", "cuda", torch.int8, None):
        with pytest.raises(ConfigError, match=rf"^head.dtype must be one of 'float32', 'bfloat16', 'float16', "
                                              rf"'float64', got {re.escape(repr(bad))}$"):
            parse_dtype(bad, key="head.dtype")


def test_bench_config_refuses_bad_values_by_its_types():
    """BenchConfig's ranges are its field types (no separate check list): each bad value names its key."""
    from eaglekit.bench.cli import BenchConfig

    for override, message in [("batch_sizes=[1,0]", r"batch_sizes must be a list of ints >= 1"),
                              ("temperatures=[]", "temperatures must be"), ("dataset=gsm8k", "dataset must be"),
                              ("repeats=0", "repeats must be an int >= 1"), ("cpu_linear=fast", "cpu_linear must be")]:
        with pytest.raises(ConfigError, match=message):
            load_config(BenchConfig, None, [override])
    assert load_config(BenchConfig, None, ["batch_sizes=[1,2]"]).batch_sizes == [1, 2]
