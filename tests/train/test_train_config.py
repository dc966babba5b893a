"""Configs: unknown keys, bad values and heads that do not fit the features are refused, naming the problem."""
from pathlib import Path

import pytest
import torch
from helpers import tiny_target

from eaglekit.config import ConfigError
from eaglekit.train.config import TrainConfig, load_train_config
from eaglekit.train.sources import build_sources

ROOT = Path(__file__).resolve().parents[2]


def test_train_unknown_key_refused_with_file_and_key(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("data:\n  conversations: sharegpt\n  batch_sise: 4\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:data.*batch_sise"):
        load_train_config(f)
    with pytest.raises(ConfigError, match="optim_lr"):
        load_train_config(None, ["data.conversations=x", "optim_lr=1"])


def test_train_bad_values_refused():
    with pytest.raises(ConfigError, match="exactly one of data.features_dir"):
        load_train_config(None, [])
    with pytest.raises(ConfigError, match="head.kind"):
        load_train_config(None, ["data.conversations=x", "head.kind=eagle2"])
    with pytest.raises(ConfigError, match="optim.lr must be a float"):
        load_train_config(None, ["data.conversations=x", "optim.lr=fast"])
    with pytest.raises(ConfigError, match="loss.cod_ratio=0.7 is a peagle option, but head.kind='eagle3'"):
        load_train_config(None, ["data.conversations=x", "loss.cod_ratio=0.7"])
    with pytest.raises(ConfigError, match="block_weights_normalized=True is a dflash / dspark / dflash2 option"):
        load_train_config(None, ["data.conversations=x", "head.kind=peagle", "loss.block_weights_normalized=true"])
    with pytest.raises(ConfigError, match="head.markov_rank=64 is a dspark option, but head.kind='dflash'"):
        load_train_config(None, ["data.conversations=x", "head.kind=dflash", "head.markov_rank=64"])
    with pytest.raises(ConfigError, match="eval_only=true needs head.init_from"):
        load_train_config(None, ["data.conversations=x", "eval_only=true"])


@pytest.mark.parametrize("extra", [["head.kind=dflash"], ["loss.objective=lk"], ["loss.topk=4", "loss.topk_weight=0.5"]])
def test_train_recompute_logits_refused_where_it_would_not_be_the_soft_ce(extra):
    """loss.recompute_logits fuses EAGLE-3's lm_head into the soft CE: another kind, objective or a top-K
    term would silently train something else."""
    with pytest.raises(ConfigError, match="recompute_logits"):
        load_train_config(None, ["data.conversations=x", "loss.recompute_logits=true", *extra])
    load_train_config(None, ["data.conversations=x", "loss.recompute_logits=false", *extra])


def test_train_recompute_logits_refused_under_zero3(monkeypatch):
    """Under ZeRO-3 the head's lm_head weight is a shard outside its forward: refused before any work."""
    from types import SimpleNamespace

    from eaglekit.train import build
    from eaglekit.train.processes import TrainError

    plugin = SimpleNamespace(zero_stage=3, deepspeed_config={})
    fake = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), distributed_type=None, device="cpu",
                           print=print, num_processes=1)
    monkeypatch.setattr(build, "Accelerator", lambda **kw: fake)
    cfg = load_train_config(None, ["data.conversations=x", "loss.recompute_logits=true", "trackers=[]"])
    with pytest.raises(TrainError, match="recompute_logits.*ZeRO-3"):
        build.make_accelerator(cfg)
    cfg.loss.recompute_logits = False
    assert build.make_accelerator(cfg) is fake and plugin.deepspeed_config["train_micro_batch_size_per_gpu"] > 0


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("prepare-")),
                         ids=lambda p: p.name)
def test_train_shipped_configs_load(path):
    # the -gpu/-long recipes leave data.conversations to their script (the regenerated file)
    cfg = load_train_config(path, [] if "conversations: null" not in path.read_text() else ["data.conversations=x"])
    assert isinstance(cfg, TrainConfig) and cfg.head.kind in path.name


@pytest.fixture(scope="module")
def eagle1_features(tmp_path_factory):
    from eaglekit.data_prep import capture_features

    target = tiny_target(vocab_size=64, hidden=32, layers=6)
    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(7, 64, (10,), generator=g), "loss_mask": torch.ones(10, dtype=torch.long)}
               for _ in range(6)]
    out = tmp_path_factory.mktemp("feats") / "eagle1"
    capture_features(target, samples, out, kind="eagle1", progress=False)
    return target, out


def test_train_head_features_mismatch_refused(eagle1_features):
    target, feats = eagle1_features
    cfg = load_train_config(None, [f"data.features_dir={feats}", "head.kind=eagle3", "data.eval_samples=2"])
    with pytest.raises(ConfigError, match=r"eagle1.*kind=eagle3|kind=eagle3.*eagle1"):
        build_sources(cfg, target)
    ok = load_train_config(None, [f"data.features_dir={feats}", "head.kind=eagle1", "data.eval_samples=2"])
    src = build_sources(ok, target)
    assert len(src.train) == 4 and len(src.eval) == 2


def test_train_features_from_another_target_refused(eagle1_features):
    _, feats = eagle1_features
    other = tiny_target(vocab_size=64, hidden=48, layers=6)
    cfg = load_train_config(None, [f"data.features_dir={feats}", "head.kind=eagle1", "data.eval_samples=2"])
    with pytest.raises(ValueError, match="hidden_size 32 vs 48"):
        build_sources(cfg, other)


@pytest.mark.parametrize("fast", [True, False])
def test_bf16_on_a_cpu_without_native_bf16_warns(monkeypatch, fast):
    """optim.bf16 on an AVX2-only CPU runs emulated bf16 kernels (~10x slower than fp32): one warning says so
    (make_accelerator prints it); fp32 or a GPU say nothing."""
    from eaglekit.train import build

    monkeypatch.setattr(build, "cpu_has_fast_bf16", lambda: fast)
    assert ("without native bf16" in (build.slow_bf16_warning(True, "cpu") or "")) is (not fast)
    assert build.slow_bf16_warning(False, "cpu") is None and build.slow_bf16_warning(True, "cuda") is None
