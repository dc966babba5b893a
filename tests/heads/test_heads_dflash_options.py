"""A DFlash head refuses the EAGLE 3.1 options it would otherwise ignore (no silent no-ops), naming them."""
import pytest
from helpers import tiny_target

from eaglekit.heads import HeadConfig, build_head


@pytest.mark.parametrize("option", ["fc_norm", "norm_output"])
def test_dflash_refuses_eagle31_options(option):
    target = tiny_target(layers=8, hidden=32, vocab_size=64)
    with pytest.raises(ValueError, match="fc_norm / norm_output .* not DFlash options"):
        build_head(HeadConfig.from_target(target, kind="dflash", block_size=4, **{option: True}), target)
    assert build_head(HeadConfig.from_target(target, kind="dflash", block_size=4), target).draft_depths == 3


def test_dflash_and_dspark_mask_a_spare_embedding_row_where_the_checkpoint_has_one():
    """A checkpoint with more embedding rows than its tokenizer has ids (Qwen's padded vocabulary): DFlash
    and DSpark feed the first spare row, untouched by any text; without spare rows, and for P-EAGLE, the
    tokenizer's pad / EOS token."""
    from helpers import tiny_model, tiny_tokenizer

    from eaglekit.target import Target

    padded = Target(tiny_model(layers=8, hidden=32, vocab_size=72), tiny_tokenizer(64), name="tiny-padded")
    exact = tiny_target(layers=8, hidden=32, vocab_size=64)
    assert max(padded.tokenizer.get_vocab().values()) == 63 and padded.vocab_size == 72
    for kind in ("dflash", "dspark"):
        cfg = HeadConfig.from_target(padded, kind=kind, block_size=4)
        assert cfg.mask_token_id == 64
        build_head(cfg, padded)  # a valid id of the target's
        assert HeadConfig.from_target(exact, kind=kind, block_size=4).mask_token_id < 64
    fallback = {exact.tokenizer.pad_token_id, exact.tokenizer.eos_token_id}
    assert HeadConfig.from_target(padded, kind="peagle").mask_token_id in fallback
    assert HeadConfig.from_target(exact, kind="dflash").mask_token_id in fallback
