"""The bench's questions: MT-bench first turns (with their category) or HumanEval, in the target's chat template."""
from __future__ import annotations

import itertools

import torch

from eaglekit import assets


def load_questions(dataset: str, n: int, order: str = "first") -> list[tuple[str, str]]:
    """``[(category, text)]``: MT-bench first turns with their category, or HumanEval ("humaneval")."""
    if order not in ("first", "spread"):
        raise ValueError(f"prompt_order={order!r}: expected 'first' or 'spread'")
    if dataset == "mt-bench":
        items = [(q["category"], q["turns"][0]) for q in assets.load_mt_bench()]
    elif dataset == "humaneval":
        items = [("humaneval", "Complete this Python function:\n```python\n" + p["prompt"] + "```")
                 for p in assets.load_humaneval()]
    else:
        raise ValueError(f"dataset={dataset!r}: expected 'mt-bench' or 'humaneval'")
    if order == "spread":  # MT-bench lists 10 questions per category in a row: take one of each in turn
        groups = {}
        for item in items:
            groups.setdefault(item[0], []).append(item)
        items = [it for row in itertools.zip_longest(*groups.values()) for it in row if it is not None]
    return items[:n]


def load_prompts(target, dataset: str, n: int, order: str = "first") -> list[torch.Tensor]:
    return [target.chat_ids(text) for _, text in load_questions(dataset, n, order)]
