"""``eaglekit generate``: chat with a target (+ an EAGLE head or a draft model), streaming, printing τ.

    eaglekit generate target=smollm2-135m-instruct head=runs/smollm2-eagle3/final
    eaglekit generate target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct gamma=5 \
        prompt="Write quicksort in Python" temperature=0.7
Without ``prompt=`` it reads user turns from stdin (an empty line or EOF ends the chat); an empty
``prompt=`` is refused (it is a mistake, not a request for a chat).

The option helpers at the end (``parse_tree``, ``load_drafter``, ...) read the options as every decode CLI
(generate, ``eaglekit bench``) and the demo spell them.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Literal

from eaglekit.config import Dtype, NonNegFloat, NonNegInt, PosFraction, PosInt, load_config
from eaglekit.decode.draft_model import ModelTreeDrafter
from eaglekit.decode.drafters import TreeSpec
from eaglekit.export import load_head
from eaglekit.heads.mtp import shipped_head
from eaglekit.target import load_target
from eaglekit.target.packed_linear import pack_linears

CPU_LINEAR = Literal["packed", "aten"]


@dataclass
class GenerateConfig:
    target: str = "smollm2-135m-instruct"
    head: str | None = None  # a saved head folder (or Hub id); "mtp": the target checkpoint's own MTP layers
    draft: str | None = None  # a draft model sharing the target's tokenizer
    prompt: str | None = None  # one turn; None = interactive chat on stdin
    system: str | None = None
    max_new_tokens: PosInt = 256
    temperature: NonNegFloat = 0.0
    top_p: PosFraction = 1.0
    top_k: NonNegInt = 0
    seed: int = 0
    tree: str = "auto"  # "auto" or "depth,top_k,total_tokens", e.g. "5,8,48"
    gamma: PosInt = 4
    draft_tree: str | None = None  # with draft=: "depth,top_k,total_tokens" grows a tree instead of a chain
    # > 0: also verify up to N tokens copied from the context (eaglekit.decode.lookup); "2,5,10": 2 tokens
    # after a 1-gram match, 5 after a 2-gram, 10 after a 3-gram (lookup.BY_MATCH, the measured best);
    # "auto": 2,5,10 with a head or draft_tree= (it paid in every measured case), off otherwise; 0: off
    prompt_lookup: int | list | str = "auto"
    dtype: Dtype = "float32"  # read by config.parse_dtype (through load_target), the one reader of dtype names
    device: str = "cpu"
    cpu_linear: CPU_LINEAR = "packed"  # "packed": oneDNN pre-packed weights on a CPU (see eaglekit.target.packed_linear); "aten"
    compile: bool = False  # the target's verify forward through torch.compile (static shapes; CUDA graphs on a GPU)
    tp_size: PosInt = 1  # > 1: the target split over tp_size processes (torchrun --nproc_per_node tp_size);
    # every process runs the same loop, the first prints


def check_split(cfg: GenerateConfig) -> None:
    """What a split target (tp_size > 1) cannot do: every process must take the same decisions."""
    if cfg.tp_size == 1:
        return
    if cfg.prompt is None:
        raise ValueError(f"tp_size={cfg.tp_size}: give prompt= (an interactive chat reads stdin on one process)")
    refuse_auto_tree_split(cfg.tp_size, cfg.tree)


def refuse_auto_tree_split(tp_size: int, tree: str) -> None:
    """tree=auto with a split target (``eaglekit generate`` and ``eaglekit bench``): refused."""
    if tp_size > 1 and tree == "auto":
        raise ValueError(f"tp_size={tp_size}: tree=auto sizes the tree from costs each process measures for "
                         "itself, so processes could pick different trees; give tree=depth,top_k,total_tokens")


def speak_on_first_process(target) -> None:
    """A split target runs the same loop on every process of its group: only the first one prints."""
    if target.layout.rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
        sys.stderr = sys.stdout


def add_arguments(p):
    p.epilog = "keys: " + ", ".join(GenerateConfig.__dataclass_fields__)


def load_models(cfg):
    """(target, drafter, linears packed) for a generate or bench config. ``tp_size`` > 1: the target split over that many
    processes (torchrun), each running the same bench; the first prints and writes. No packed linears then
    (DTensor weights), for every method alike."""
    target = load_target(cfg.target, dtype=cfg.dtype, device=cfg.device, tp_size=cfg.tp_size, only_tp=True)
    speak_on_first_process(target)
    drafter = load_drafter(cfg, target)
    packed = use_cpu_linear("aten" if cfg.tp_size > 1 else cfg.cpu_linear, target, drafter)  # HF's too
    return target, drafter, packed


def run(args) -> int:
    from transformers import TextStreamer

    from eaglekit.decode.api import generate

    cfg = load_config(GenerateConfig, args.config, args.overrides)
    if cfg.prompt is not None and not cfg.prompt.strip():
        raise ValueError("prompt= is empty: give the turn's text (prompt=\"...\"), or leave prompt out to chat "
                         "on stdin")
    lookup_by_default = cfg.prompt_lookup == "auto"
    if lookup_by_default:
        from eaglekit.decode.lookup import BY_MATCH

        cfg.prompt_lookup = ",".join(map(str, BY_MATCH)) if cfg.head or cfg.draft_tree else 0
    if cfg.prompt_lookup:  # before loading models or reading a turn
        from eaglekit.decode.lookup import SAMPLED, branch_lengths

        branch_lengths(cfg.prompt_lookup)
        if cfg.draft and not cfg.draft_tree:
            raise ValueError(f"prompt_lookup={cfg.prompt_lookup} with draft= and no draft_tree=: {SAMPLED}")
    check_split(cfg)
    target, drafter, _ = load_models(cfg)
    if lookup_by_default and getattr(target, "own_cache", False):  # a lookup branch beside a head is a tree, which
        cfg.prompt_lookup = 0  # a recurrent target verifies a row per path (both paths' shared root twice): asked only
    drafter = with_draft_tree(cfg, target, drafter)
    tree = parse_tree(cfg.tree)
    messages = [{"role": "system", "content": cfg.system}] if cfg.system else []
    turns = [cfg.prompt] if cfg.prompt else None
    while True:
        if turns is None:
            print("\nuser> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line.strip():
                return 0
            text = line.strip()
        elif turns:
            text = turns.pop(0)
        else:
            return 0
        messages.append({"role": "user", "content": text})
        ids = target.chat_ids(messages)
        streamer = TextStreamer(target.tokenizer, skip_prompt=True, skip_special_tokens=True)
        out = generate(target, drafter, ids, cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                       top_k=cfg.top_k, seed=cfg.seed, tree=tree, gamma=cfg.gamma, streamer=streamer,
                       prompt_lookup=cfg.prompt_lookup, compile=cfg.compile)
        answer = target.tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        s = out.stats
        kind = "plain" if drafter is None else "head" if cfg.head else \
            f"draft model, tree {cfg.draft_tree}" if cfg.draft_tree else f"draft model, gamma={cfg.gamma}"
        kind += f" + prompt lookup {cfg.prompt_lookup}" if cfg.prompt_lookup else ""
        print(f"\n[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tokens/s, tau={s.tau:.2f} ({kind}), "
              f"acceptance per depth {s.depth_summary()}]", file=sys.stderr)


# ---- options as the CLIs (generate, bench) and the demo spell them -------------------------------------

def parse_tree(text: str):
    """``tree=``/``draft_tree=``: "auto" or "depth,top_k,total_tokens" (e.g. "5,8,48") as a ``TreeSpec``."""
    return "auto" if text == "auto" else TreeSpec.parse(text)


def load_drafter(cfg, target):
    """``cfg.head`` (a saved head folder or Hub id; ``mtp``: the MTP layers the target's checkpoint ships) or
    ``cfg.draft`` (a draft model), loaded for ``target``."""
    if cfg.head and cfg.draft:
        raise ValueError("give either head= or draft=, not both")
    if cfg.head == "mtp":
        return shipped_head(target)
    if cfg.head:
        return load_head(cfg.head, target)
    if cfg.draft:
        return load_target(cfg.draft, dtype=target.dtype, device=cfg.device)
    return None


def with_draft_tree(cfg, target, drafter):
    """``draft_tree=`` with ``draft=``: wrap the draft model in a ``ModelTreeDrafter``; else unchanged."""
    if not cfg.draft_tree:
        return drafter
    if not cfg.draft:
        raise ValueError("draft_tree= needs draft= (a head drafts a tree through tree=)")
    return ModelTreeDrafter(target, drafter, parse_tree(cfg.draft_tree))


def use_cpu_linear(choice: str, *models) -> int:
    """Apply ``cpu_linear=`` to targets / heads / draft models (None skipped); returns linears packed."""
    if choice not in ("packed", "aten"):
        raise ValueError(f"cpu_linear={choice!r}: expected 'packed' or 'aten'")
    if choice == "aten":
        return 0
    return sum(pack_linears(getattr(m, "model", m)) for m in models if m is not None)
