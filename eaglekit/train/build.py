"""A training run assembled from parts, each built by one function from the config (SpecForge-style):

    acc = make_accelerator(cfg); lock = lock_output_dir(acc, cfg.output_dir)
    target = build_target(cfg, acc.device)           # frozen, whole on every rank (ZeRO-3 included)
    sources = build_sources(cfg, target)             # train / held-out items, the data's draft vocabulary
    head = build_train_head(cfg, target, sources)    # shaped from both; head.init_from / init_from_target
    optimizer, scheduler = build_optimizer(cfg.optim, head, total_steps, state)

``assemble`` runs the first four (and the teacher) for both entry points, ``trainer.train`` and
``evaluate.evaluate_only``; neither Trainer nor the evaluation builds anything.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DistributedType,
    InitProcessGroupKwargs,
    is_tensorboard_available,
    is_wandb_available,
    set_seed,
)

from eaglekit.export import load_head
from eaglekit.heads import DraftHead, HeadConfig, build_head
from eaglekit.heads.objectives import Teacher
from eaglekit.target import Target, load_target_from
from eaglekit.target.borrowed import keep_rows
from eaglekit.train.config import TrainConfig
from eaglekit.train.data import KnownTops, fetch
from eaglekit.train.processes import OutputDirLock, TrainError, exit_with_launcher, reduce_sum
from eaglekit.train.sources import Sources, build_sources


@dataclass
class Parts:
    """What a run trains or evaluates, built from its config; ``lock`` holds ``output_dir`` until released."""
    acc: Accelerator
    lock: OutputDirLock
    target: Target
    sources: Sources
    head: DraftHead
    teacher: Teacher


def assemble(cfg: TrainConfig) -> Parts:
    """The accelerator, the locked output_dir, target, sources, head and teacher for ``cfg``; the lock is
    released if a later part fails."""
    exit_with_launcher()  # a worker of accelerate launch / torchrun dies with its launcher
    acc = make_accelerator(cfg)
    lock = lock_output_dir(acc, cfg.output_dir)
    try:
        set_seed(cfg.seed)
        target = build_target(cfg, acc.device)
        sources = build_sources(cfg, target)
        head = build_train_head(cfg, target, sources)
        teacher = Teacher.of(target.lm_head, head.t2d)  # a head without draft vocab: all of it
        if cfg.data.keep_target_rows and cfg.data.features_dir and not needs_decoder(cfg) and head.has_draft_vocab:
            keep_target_rows(target, sources, head, teacher, cfg.loss.chunk_tokens, acc.device)
    except BaseException:
        lock.release()
        raise
    return Parts(acc, lock, target, sources, head, teacher)


def keep_target_rows(target, sources: Sources, head, teacher: Teacher, chunk: int, device) -> None:
    """Offline training without the decoder reads the target's lm_head only for each item's teacher argmax
    (over the whole vocabulary) and its draft rows, and its embedding only at the tokens the capture holds.
    So every item's argmax is computed here, once (kept in RAM: 4 bytes a token; it also spares later epochs
    that product), and then only those rows are kept: for Qwen2.5-1.5B's untied 151,936 x 1,536 tables in
    bf16, 0.93 GB become the draft vocabulary's rows plus the capture's tokens. Each process reads every item."""
    source = sources.train.source  # the training and held-out splits view one source
    tops, seen = {}, {0}  # 0: what shifted and padded ids hold
    if head.config.mask_token_id >= 0:
        seen.add(head.config.mask_token_id)
    for start in range(0, len(source), 16):
        indices = list(range(start, min(len(source), start + 16)))
        for i, item in zip(indices, fetch(source, indices)):
            tops[i] = teacher.targets(item["last"][None].to(device), chunk)[0].to(torch.int32).cpu()
            seen.update(torch.as_tensor(item["input_ids"]).unique().tolist())
    sources.train.source = sources.eval.source = KnownTops(source, tops)
    draft_rows = torch.arange(head.config.draft_vocab_size) + head.d2t.cpu()
    keep_rows(target, torch.tensor(sorted(seen)), draft_rows)
    head.bind(target)  # the head borrows the kept rows now
    teacher.lm_head_weight = teacher.bias = None  # (the draft rows' bias, draft_bias, stays)
    if torch.equal(teacher.draft_weight, target.lm_head.rows):  # the same rows, both in target-id order:
        teacher.draft_weight = target.lm_head.rows  # held once


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    handlers = [InitProcessGroupKwargs(backend="gloo")] if launched and not torch.cuda.is_available() else []
    trackers = [t for t in cfg.trackers if _tracker_available(t)]
    acc = Accelerator(gradient_accumulation_steps=cfg.optim.grad_accum,
                      mixed_precision="bf16" if cfg.optim.bf16 else "no", log_with=trackers or None,
                      project_dir=cfg.output_dir, kwargs_handlers=handlers, step_scheduler_with_optimizer=False)
    if launched and acc.distributed_type == DistributedType.NO:  # e.g. torchrun on a CPU without the variable
        raise TrainError(f"{os.environ['WORLD_SIZE']} processes were launched, but Accelerate runs each one alone "
                         "(no gradient exchange between them): on a CPU set ACCELERATE_USE_CPU=1 (accelerate "
                         "launch --multi_gpu, or torchrun)")
    if (warning := slow_bf16_warning(cfg.optim.bf16, acc.device)):
        acc.print(warning)
    if acc.state.deepspeed_plugin is not None:  # no dataloader goes through prepare: say the sizes here
        if cfg.loss.recompute_logits and acc.state.deepspeed_plugin.zero_stage == 3:
            raise TrainError("loss.recompute_logits reads the head's lm_head weight outside its forward, where "
                             "ZeRO-3 holds only a shard of it: set it false under ZeRO-3")
        ds = acc.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = cfg.data.batch_size
        ds["train_batch_size"] = cfg.data.batch_size * cfg.optim.grad_accum * acc.num_processes
        ds["gradient_accumulation_steps"] = cfg.optim.grad_accum
        ds["gradient_clipping"] = cfg.optim.grad_clip
    return acc


def slow_bf16_warning(bf16: bool, device) -> str | None:
    """A warning when ``optim.bf16`` would autocast on a CPU without native bf16 kernels."""
    if bf16 and torch.device(device).type == "cpu" and not cpu_has_fast_bf16():
        return ("[eaglekit.train] warning: optim.bf16=true on a CPU without native bf16 (no avx512_bf16/AMX): "
                "autocast runs emulated kernels, ~10x slower than fp32 here; set optim.bf16=false")
    return None


def cpu_has_fast_bf16() -> bool:
    """Whether oneDNN has native bf16 kernels on this CPU (else bf16 matmuls are emulated, and slow)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True  # unknown: say nothing


def _tracker_available(name: str) -> bool:
    ok = {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available}.get(name, lambda: True)()
    if not ok:
        print(f"[eaglekit.train] tracker {name!r} is not installed; logging to log.jsonl only")
    return ok


def lock_output_dir(acc: Accelerator, output_dir) -> OutputDirLock:
    """The main process locks ``output_dir`` for the run; every rank learns whether it could."""
    lock, error = OutputDirLock(output_dir), None
    if acc.is_main_process:
        try:
            lock.acquire()
        except TrainError as e:
            error = e
    if reduce_sum(acc, [float(error is not None)])[0]:
        raise error or TrainError(f"output_dir {output_dir} is in use by another run", quiet=True)
    return lock


@contextlib.contextmanager
def no_zero3_partitioning():
    """Hide Accelerate's ZeRO-3 config from transformers while loading the target: otherwise
    ``from_pretrained`` partitions the frozen weights (lm_head of shape [0]) whatever zero3_init_flag says."""
    try:
        import transformers.integrations.deepspeed as hf_ds  # only where the deepspeed integration imports
    except ImportError:
        yield
        return
    saved = getattr(hf_ds, "_hf_deepspeed_config_weak_ref", None)
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


def build_target(cfg: TrainConfig, device) -> Target:
    """The frozen target of ``cfg.target`` on ``device`` (this process's), whole on every rank, or only the
    modules the head borrows where nothing runs the decoder (``needs_decoder``)."""
    with no_zero3_partitioning():
        return load_target_from(cfg.target, device=device, decoder=needs_decoder(cfg))


def needs_decoder(cfg: TrainConfig) -> bool:
    """Whether training runs (or reads) the target's decoder layers: online features, a layer warm start, an
    adapter (it may touch any module) or a split target do; training from captured features reads only the
    embedding, final norm and lm_head — for a large target a tenth of its bytes or less."""
    if cfg.data.load_target_decoder is not None:
        return cfg.data.load_target_decoder
    t = cfg.target
    return bool(cfg.data.conversations or cfg.head.init_layer_from_target or t.adapter or t.tp_size > 1)


def build_train_head(cfg: TrainConfig, target: Target, sources: Sources) -> DraftHead:
    """The fp32 head ``cfg.head`` describes, shaped like the target, with the taps and draft vocabulary of the
    data; ``head.init_from`` starts it from a saved head (its weights and its draft vocabulary, which then
    replaces the data's — ``sources`` stay as they are), else ``head.init_from_target`` from the target's
    own modules (what that means is the head class's: EAGLE-3 copies lm_head rows and the final norm)."""
    h = cfg.head
    start = _start_head(h.init_from, target, cfg, sources) if h.init_from else None
    vocab = (start.d2t.cpu(), start.t2d.cpu()) if start is not None and start.has_draft_vocab else sources.vocab
    config = HeadConfig.from_target(target, kind=h.kind, num_layers=h.num_layers,
                                    draft_vocab_size=vocab[0].numel() if vocab is not None else None,
                                    aux_layer_ids=list(sources.layer_ids) or None, block_size=h.block_size or None,
                                    fc_norm=h.fc_norm, norm_output=h.norm_output,
                                    norm_before_fc=h.norm_before_fc, markov_rank=h.markov_rank,
                                    conv_kernel_size=h.conv_kernel_size, conv_group_size=h.conv_group_size,
                                    selector_rank=h.selector_rank, selector_top_k=h.selector_top_k,
                                    train_embedding=h.train_embedding, mask_embedding=h.mask_embedding,
                                    **({"intermediate_size": h.intermediate_size} if h.intermediate_size else {}))
    head = build_head(config, target, dtype=torch.float32)
    if vocab is not None:
        head.set_draft_vocab(*vocab)
    if start is not None:
        head.load_state_dict(start.state_dict())
    elif h.init_from_target:
        head.init_from_target(target)
    if start is None and h.init_layer_from_target:
        if not hasattr(head, "init_layer_from_target"):
            raise ValueError(f"head.init_layer_from_target: a {h.kind} head has no such warm start (EAGLE-3 only)")
        head.init_layer_from_target(target)
    return head


def _start_head(path: str, target: Target, cfg: TrainConfig, sources: Sources) -> DraftHead:
    """A saved head to start from, refused unless it is the head this run would build (kind, layers, taps)."""
    head = load_head(path, target, dtype=torch.float32, device="cpu")
    c, h = head.config, cfg.head
    theirs = {"kind": c.kind, "num_layers": c.num_layers, "aux_layer_ids": list(c.aux_layer_ids or []),
              "fc_norm": c.fc_norm, "norm_output": c.norm_output, "norm_before_fc": c.norm_before_fc,
              "train_embedding": c.train_embedding, "mask_embedding": c.mask_embedding}
    ours = {"kind": h.kind, "num_layers": h.num_layers, "aux_layer_ids": list(sources.layer_ids),
            "fc_norm": h.fc_norm, "norm_output": h.norm_output, "norm_before_fc": h.norm_before_fc,
            "train_embedding": h.train_embedding, "mask_embedding": h.mask_embedding}
    if theirs != ours:
        raise ValueError(f"head.init_from={path}: the saved head has {theirs}, this run wants {ours}")
    return head


def lr_lambda(total: int, warmup: int, min_ratio: float, spent=None):
    """Linear warmup to 1, then cosine to ``min_ratio`` at ``total`` steps.

    ``spent()`` (the fraction of a wall-clock budget used, 0..1) moves the cosine along whichever is
    further, steps or time, so a run that the budget stops early still ends annealed at ``min_ratio``."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        if spent is not None:
            frac = max(frac, min(1.0, spent()))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    return f


def build_optimizer(optim, head: DraftHead, total_steps: int, state):
    """AdamW over the head and its warmup + cosine schedule (``optim``: the config's ``optim`` section);
    under ``optim.max_minutes`` the schedule also follows the time ``state.seconds`` says is spent."""
    opt = torch.optim.AdamW(head.parameters(), lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)
    warmup = optim.warmup_steps or int(optim.warmup_ratio * total_steps)
    spent = (lambda: state.seconds / (60 * optim.max_minutes)) if optim.max_minutes > 0 else None
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps, warmup, optim.min_lr_ratio, spent))
    return opt, scheduler
