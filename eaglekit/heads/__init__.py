"""EAGLE draft heads: EAGLE-1 (feature regression) and EAGLE-3 (fused taps, draft vocabulary).

    cfg = HeadConfig.from_target(target, kind="eagle3")
    head = build_head(cfg, target)
    hidden, logits = head.step(input_ids, head.fuse_output(target_out), position_ids, cache=HeadCache())
"""
from eaglekit.heads.cache import HeadCache, causal_mask, ttt_mask
from eaglekit.heads.config import HeadConfig
from eaglekit.heads.eagle1 import Eagle1Head
from eaglekit.heads.eagle3 import Eagle3Head
from eaglekit.heads.export import LAYOUTS, export_head, load_export, validate_export
from eaglekit.heads.hub import model_card, push_to_hub
from eaglekit.heads.io import build_head, check_target, load_head, save_head

__all__ = ["HeadConfig", "Eagle1Head", "Eagle3Head", "HeadCache", "build_head", "load_head", "save_head",
           "check_target", "causal_mask", "ttt_mask", "export_head", "load_export", "validate_export", "LAYOUTS",
           "push_to_hub", "model_card"]
