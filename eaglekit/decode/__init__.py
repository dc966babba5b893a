"""Lossless speculative decoding: EAGLE-2 trees from a head, a draft model's chain, or plain decoding.

``decode.generate(target, drafter, input_ids, ...)`` with ``drafter`` an EAGLE head, another Target
sharing the tokenizer (a chain of ``gamma`` tokens; ``ModelTreeDrafter`` for a tree), or None;
``prompt_lookup=N`` grafts a prompt-lookup branch onto the tree (``LookupDrafter``).
See ``eaglekit/decode/generate.py`` for the loop.
"""
from eaglekit.decode.drafters import ModelTreeDrafter
from eaglekit.decode.generate import DecodeStats, GenerateOutput, generate
from eaglekit.decode.lookup import LookupDrafter
from eaglekit.decode.sampling import Sampling
from eaglekit.decode.tree import Tree, TreeSpec

__all__ = ["DecodeStats", "GenerateOutput", "LookupDrafter", "ModelTreeDrafter", "Sampling", "Tree", "TreeSpec", "generate"]
