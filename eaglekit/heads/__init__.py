"""Draft heads, one registry of kinds: EAGLE-1 (feature regression), EAGLE-3 (fused taps, draft vocabulary;
EAGLE 3.1's fc_norm / norm_output and norm_before_fc as options), and the parallel drafters P-EAGLE (EAGLE-3's
network filling a block of mask slots in one forward), DFlash (block diffusion over the target's taps),
DSpark (DFlash plus a previous-token logit bias chained through the block, and a confidence head) and DFlash 2
(DFlash plus an in-block dynamic convolution and a candidate selector walked through the block); and MTP, the
multi-token-prediction layers a target ships (or a fresh one of the target's decoder-layer class).

    cfg = HeadConfig.from_target(target, kind="eagle3")
    head = build_head(cfg, target)
    out = target.forward(ids, layer_ids=head.taps)
    hidden, logits = head.step(input_ids, head.fuse_output(out), position_ids, cache=HeadCache())

The engines' layouts (vLLM, SGLang, speculators, llama.cpp, EAGLE-1), ``load_head`` for any of them and
the Hub push live in eaglekit/export/, above this package. Modules, each importing only modules on the
lines below it (tests/test_architecture.py checks):

    io                      the native format: save_head (DraftHead.save_pretrained), load_native
    registry                HEADS by kind, head_class, build_head, tap_layers
    dspark                  DSpark: DFlash + the previous-token ("Markov") bias and the confidence head
    dflash                  DFlash: the block-diffusion drafter (one forward fills a block); DFlash 2
                            (its convolution and candidate selector) beside it
    eagle1, eagle3          the heads: what each reads, fuses, predicts over and trains with (eagle3 also
                            holds P-EAGLE, its network drafting a block in one forward)
    mtp                     the MTP (next-n) layers a target ships, read from its checkpoint (DeepSeek-V3,
                            GLM-4.5): transformers' MtpLayer around the target's own decoder layer
    base                    DraftHead: borrowed target modules, draft vocabulary, step checks;
                            ParallelHead, the base of the heads that draft a block in one forward
    layers                  Llama-style layers; HeadCache (and HeadRows: a head's decode rows), masks,
                            shift_left
    config                  HeadConfig, the kinds, check_target
"""
from eaglekit.heads.base import DraftHead
from eaglekit.heads.config import EAGLE1, EAGLE3, KINDS, HeadConfig, check_target
from eaglekit.heads.eagle1 import Eagle1Head
from eaglekit.heads.eagle3 import Eagle3Head
from eaglekit.heads.io import load_native, save_head
from eaglekit.heads.layers import HeadCache, causal_mask, ttt_mask
from eaglekit.heads.registry import HEADS, build_head, head_class, tap_layers

__all__ = ["EAGLE1", "EAGLE3", "HEADS", "KINDS", "DraftHead", "Eagle1Head", "Eagle3Head", "HeadCache", "HeadConfig",
           "build_head", "causal_mask", "check_target", "head_class", "load_native", "save_head", "tap_layers",
           "ttt_mask"]
