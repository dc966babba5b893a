"""DFlash 2 through the trainer on a tiny target: online (features computed as it trains) and offline (an
EAGLE-3 capture: the same default taps as DFlash), its options (the convolution's and the selector's sizes,
the selector's weight and its missing-gold rule) reaching the saved head; a few online steps raise held-out
τ_sim over the untrained head (the stats count the selector's pick)."""
import pytest
import torch
from helpers import save_tiny, tiny_conversations

from eaglekit.export import load_head

pytestmark = pytest.mark.usefixtures("one_thread")
COMMON = ["head.kind=dflash2", "head.draft_vocab_size=64", "head.selector_rank=8", "head.selector_top_k=4",
          "head.conv_group_size=8", "progress=false", "trackers=[]", "eval_interval=0", "save_interval=0"]


def test_dflash2_trains_online_and_beats_untrained_on_held_out_tau(tmp_path):
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import train

    save_tiny(tmp_path / "tiny", vocab_size=64, hidden=32, layers=4)
    tiny_conversations(tmp_path / "convs.jsonl", n=40)

    def run(name, *extra):
        return train(load_train_config(None, [
            f"target={tmp_path / 'tiny'}", f"data.conversations={tmp_path / 'convs.jsonl'}", "data.eval_samples=6",
            "head.block_size=4", "head.num_layers=1", "loss.ttt_steps=3", "data.batch_size=4", *COMMON,
            f"output_dir={tmp_path / name}", *extra]))

    untrained = run("untrained", "optim.lr=0", "optim.max_steps=1")
    trained = run("trained", "optim.lr=5e-3", "optim.epochs=10", "loss.selector_missing=drop")
    assert trained["eval_tau_sim"] > untrained["eval_tau_sim"] + 0.1, (trained, untrained)
    assert untrained["eval_candidate_recall"] < trained["eval_candidate_recall"] <= 1.0  # logged, and it learns
    from eaglekit.target import load_target

    head = load_head(tmp_path / "trained" / "final", load_target(tmp_path / "tiny"))
    assert (head.config.kind, head.config.selector_rank, head.config.selector_top_k, head.config.conv_group_size,
            head.config.conv_kernel_size) == ("dflash2", 8, 4, 8, 2)
    assert head.candidate_selector.successor_codebook.abs().max() > 0  # trained away from its zero start


def test_dflash2_trains_offline_on_an_eagle3_capture(tmp_path):
    from eaglekit.data_prep import capture_features, read_conversations, tokenize_conversations
    from eaglekit.target import load_target
    from eaglekit.train.config import load_train_config
    from eaglekit.train.trainer import train

    save_tiny(tmp_path / "tiny", vocab_size=64, hidden=32, layers=4)
    tiny = load_target(tmp_path / "tiny")
    convs = read_conversations(tiny_conversations(tmp_path / "c.jsonl", n=12))
    samples, _ = tokenize_conversations(tiny.tokenizer, convs, 64)
    capture_features(tiny, samples, tmp_path / "feats", kind="eagle3", progress=False)
    final = train(load_train_config(None, [
        f"target={tmp_path / 'tiny'}", f"data.features_dir={tmp_path / 'feats'}", "data.eval_samples=3",
        "head.block_size=3", "loss.ttt_steps=2", "data.batch_size=3", "loss.selector_weight=0.5",
        "loss.block_weighting=dpace", "optim.max_steps=3", *COMMON, f"output_dir={tmp_path / 'out'}"]))
    assert final["step"] == 3 and {"eval_acc_0", "eval_acc_1", "eval_tau_sim"} <= set(final)
    head = load_head(tmp_path / "out" / "final", tiny)
    assert head.config.kind == "dflash2" and head.taps == tuple(tiny.default_taps)
    assert not torch.equal(head.layers[0].mlp_conv.kernel_projection.weight,
                           torch.zeros_like(head.layers[0].mlp_conv.kernel_projection.weight))


def test_dflash2_options_are_refused_for_other_kinds():
    from eaglekit.train.config import ConfigError, load_train_config

    for key in ("head.selector_rank=8", "loss.selector_missing=drop", "loss.selector_weight=0.5"):
        with pytest.raises(ConfigError, match="is a dflash2 option"):
            load_train_config(None, ["target=x", "data.conversations=c.jsonl", "head.kind=dflash", key])


def test_dflash2_gpu_config_is_the_published_recipe():
    from pathlib import Path

    from eaglekit.train.config import load_train_config

    cfg = load_train_config(Path(__file__).resolve().parents[2] / "configs" / "qwen3-8b-dflash2.yaml")
    h = cfg.head
    assert (h.kind, h.num_layers, h.block_size, h.selector_top_k, h.selector_rank, h.conv_kernel_size,
            h.conv_group_size) == ("dflash2", 5, 16, 16, 256, 2, 16)
    assert (cfg.loss.selector_weight, cfg.loss.ttt_steps, h.draft_vocab_size) == (1.0, 15, 151936)
