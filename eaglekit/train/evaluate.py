"""Held-out evaluation: top-1 accuracy per TTT step, τ_sim and τ_chain (metrics.py), sharded across ranks;
``evaluate_only``, the entry point that scores a saved head (``head.init_from``) without training it; and
the run log (``log.jsonl`` + trackers) both entry points write."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from eaglekit.fileio import write_text
from eaglekit.heads.objectives import TTTModel
from eaglekit.target.tensor_parallel import data_parallel
from eaglekit.timing import Stopwatch
from eaglekit.train.build import assemble
from eaglekit.train.config import TrainConfig
from eaglekit.train.data import collate, fetch_with_top, tensors_to
from eaglekit.train.metrics import Tally, peak_memory_mb
from eaglekit.train.processes import reduce_sum


@torch.no_grad()
def evaluate(acc, model, head, teacher, source, cfg: TrainConfig, shares: tuple[int, int] | None = None) -> dict:
    """``eval_*`` metrics of ``model`` (a TTTModel, maybe wrapped) on ``source``, each rank a share
    (``shares``: (world, rank) to split over, e.g. TP groups that each run one share together)."""
    world, rank = shares or (acc.num_processes, acc.process_index)
    d = cfg.data
    steps = cfg.eval_ttt_steps or cfg.loss.ttt_steps
    order = sorted(range(len(source)), key=lambda i: source.lengths[i])
    mbs = [order[i:i + d.batch_size] for i in range(0, len(order), d.batch_size)]
    model.eval()
    tally = Tally()
    for mb in mbs[rank::world]:
        items = fetch_with_top(source, mb, teacher, cfg.loss.chunk_tokens, acc.device)
        _, stats = model(**tensors_to(collate(items, head.reads), acc.device), steps=steps, train=False)
        tally.add(stats)
    if not tally.total:
        tally = Tally([0.0] * steps, [0.0] * steps, [0.0] * steps)
    depths = head.draft_depths if hasattr(head, "candidate_selector") else 0  # DFlash 2: its selector's recall
    return Tally.from_list(reduce_sum(acc, tally.as_list())).summary("eval_", recall_depths=depths)


def append_log(acc, path: Path, record: dict) -> None:
    """One ``log.jsonl`` line (main process) and the numbers to the trackers."""
    if acc.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
    acc.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])


def run_facts(acc) -> dict:
    """Where a run ran, for its final record."""
    return {"peak_memory_mb": peak_memory_mb(acc.device), "processes": acc.num_processes,
            "distributed_type": str(acc.distributed_type).split(".")[-1]}


def evaluate_only(cfg: TrainConfig) -> dict:
    """Score the saved head ``head.init_from`` on the held-out split of ``cfg``'s data, unchanged: the final
    ``log.jsonl`` record and ``metrics.json`` (with ``eval_of``), no checkpoint, no ``final/``."""
    if not cfg.head.init_from:
        raise ValueError("eval_only=true needs head.init_from=<saved head> to evaluate")
    parts = assemble(cfg)
    acc, out = parts.acc, Path(cfg.output_dir)
    try:
        acc.init_trackers("eaglekit", config={"output_dir": cfg.output_dir})
        model = acc.prepare(TTTModel(parts.head, parts.teacher, cfg.loss))
        watch = Stopwatch(acc.device)
        final = evaluate(acc, model, parts.head, parts.teacher, parts.sources.eval, cfg,
                         data_parallel(acc, parts.target))
        final.update(step=0, eval_seconds=watch.elapsed(), **run_facts(acc))
        append_log(acc, out / "log.jsonl", {**final, "final": True})
        acc.print("[eaglekit.train] held-out " + " ".join(f"{k}={v:.4g}" for k, v in final.items()
                                                          if isinstance(v, float)))
        if acc.is_main_process:
            write_text(out / "metrics.json", json.dumps({**final, "eval_of": cfg.head.init_from}, indent=1))
        acc.end_training()
        return final
    finally:
        parts.lock.release()
