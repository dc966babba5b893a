"""``eaglekit demo``: the main job on the embedded default target.

For now: load SmolLM2-135M-Instruct from the asset cache and answer one MT-bench question with plain
greedy decoding, streaming the text and printing tokens/s.
"""
from __future__ import annotations

import time

import torch

from eaglekit import assets
from eaglekit.target import load_target


def add_arguments(p):
    p.add_argument("--target", default=assets.DEFAULT_TARGET)
    p.add_argument("--question", type=int, default=0, help="index of the MT-bench question")
    p.add_argument("--max-new-tokens", type=int, default=128)


def run(args) -> int:
    from transformers import TextStreamer

    torch.manual_seed(0)
    target = load_target(args.target)
    q = assets.load_mt_bench()[args.question]
    msgs = [{"role": "user", "content": q["turns"][0]}]
    ids = target.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    print(f"[{q['category']}] {q['turns'][0]}\n")
    t0 = time.perf_counter()
    out = target.model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                streamer=TextStreamer(target.tokenizer, skip_prompt=True, skip_special_tokens=True))
    dt = time.perf_counter() - t0
    n = out.shape[1] - ids.shape[1]
    print(f"\n{n} tokens in {dt:.1f} s = {n / dt:.1f} tokens/s (plain greedy decoding, {target.dtype})")
    return 0
