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
