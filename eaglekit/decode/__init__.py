"""Lossless speculative decoding: EAGLE-2 trees from a head, a draft model's chain or tree, prompt lookup,
or plain decoding; one loop for every drafter.

``decode.generate(target, drafter, input_ids, ...)`` with ``drafter`` an EAGLE head (a parallel one, P-EAGLE
or DFlash, drafts its tree in one forward: ``ParallelDrafter``), another Target
sharing the tokenizer (a chain of ``gamma`` tokens; ``ModelTreeDrafter`` for a tree), any ``Drafter``,
or None; ``prompt_lookup=N`` grafts a prompt-lookup branch onto the tree (``LookupDrafter``). A list of
prompts (or [B, T] with ``attention_mask``) decodes as a batch, each row exactly as it would alone.
Modules, each importing only modules on the lines below it:

    cli                     eaglekit generate, and the options every decode CLI spells alike (parse_tree, ...)
    api                     the public call generate: which drafter (make_drafter, make_row_drafters), then
                            loop.run
    cost                    measured costs and tree="auto"'s plan (auto_plan, Plan)
    lookup, draft_model     the prompt-lookup wrapper; a draft model's chain (ModelDrafter) and tree
                            (ModelTreeDrafter), through its ModelProposer
    mtp_walk                an MTP head of several layers, one per depth (MtpWalkDrafter: vLLM's multi-module chain)
    loop                    the loop for one row or many (Decoder.step: draft, verify, accept, keep, commit);
                            Sampling and the acceptance rules
    drafters                Drafter protocol: PlainDrafter, TreeDrafter (EagleDrafter: a head's EAGLE-2 tree,
                            grown by its HeadProposer; the head catch-up of every row at once), ParallelDrafter
                            (a parallel head: one forward per step); Tree, TreeSpec and the EAGLE-2 expand
    stats, stops            DecodeStats, BatchStats; what ends a row (EOS, stop strings, max tokens)

The target's KV cache (RowsCache, keep_accepted) lives beside the target, in eaglekit/target/cache.py.
"""
from eaglekit.decode.api import generate, make_drafter
from eaglekit.decode.cost import Plan, auto_plan
from eaglekit.decode.draft_model import ModelTreeDrafter
from eaglekit.decode.drafters import (
    Drafter,
    EagleDrafter,
    ParallelDrafter,
    PlainDrafter,
    Tree,
    TreeDrafter,
    TreeSpec,
)
from eaglekit.decode.lookup import LookupDrafter
from eaglekit.decode.loop import GenerateOutput, Sampling
from eaglekit.decode.stats import BatchStats, DecodeStats

__all__ = [
           "BatchStats",
           "DecodeStats",
           "Drafter",
           "EagleDrafter",
           "GenerateOutput",
           "LookupDrafter",
           "ModelTreeDrafter",
           "ParallelDrafter",
           "PlainDrafter",
           "Plan",
           "Sampling",
           "Tree",
           "TreeDrafter",
           "TreeSpec",
           "auto_plan",
           "generate",
           "make_drafter",
]
