"""Heads in the engines' layouts: vLLM, SGLang, speculators, llama.cpp (GGUF) and EAGLE-1's, for every kind
an engine serves (EAGLE-3 with EAGLE 3.1's options or norm_before_fc, P-EAGLE, DFlash, DSpark, DFlash 2, EAGLE-1), read back
by ``load_head`` (native or any layout), and the Hugging Face Hub push with its model card.

    export_head(head, "out/vllm", layout="vllm")          # refuses what the engine would drop or misread
    head = load_head("out/vllm", target)                   # any layout, checked against the target
    push_head(head, "me/my-head", layout="speculators")    # also head.push_to_hub(...)

Modules, each importing only modules on the lines below it (tests/test_architecture.py checks):

    cli, push_cli           eaglekit export / eaglekit push
    hub                     model card, stage, push_head (DraftHead.push_to_hub)
    formats                 write the engine layouts (export_head, export_to); load_head
    layouts                 the layouts' key sets and renames, what each engine holds; validate_export
    dflash2_layout          DFlash 2's HF / z-lab layout (llama.cpp's converter reads it) and speculators' dflash2
    dspark_layout           speculators' dspark layout (DSpark; llama.cpp's draft-dspark converts it): write, load
    dflash_layout           the DFlash layout SGLang and vLLM read (its keys, config, the causal-layer rule)
    engines, verifier       data: how each engine's loader reads an export; the verifier id an export names
"""
from eaglekit.export.formats import export_head, load_export, load_head
from eaglekit.export.hub import model_card, push_head
from eaglekit.export.layouts import LAYOUTS, validate_export

__all__ = ["LAYOUTS", "export_head", "load_export", "load_head", "model_card", "push_head", "validate_export"]
