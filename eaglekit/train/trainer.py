"""The training loop: Accelerate (single process, DDP, DeepSpeed ZeRO-2/3), AdamW, warmup + cosine,
grad clipping and accumulation, full-state checkpoints with ``resume=auto``, held-out τ_sim.

Loss normalisation: each optimizer step's loss is (sum over every supervised position of the global
batch, all ranks and micro-batches) / (their count), so 1 process with grad_accum=2 and 2 processes
with grad_accum=1 take the same step (DDP and ZeRO average over ranks, accumulation over micro-batches;
``scale`` undoes both).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import time
from pathlib import Path

import torch
from torch import nn

from eaglekit.fileio import write_text
from eaglekit.train import resume as checkpoints
from eaglekit.train.checkpoint import TrainState
from eaglekit.train.config import TrainConfig
from eaglekit.train.data import Schedule, collate, fetch, plan_micro_batches, to_device
from eaglekit.train.finite import refuse_non_finite_weights, stop_if_not_finite
from eaglekit.train.losses import Teacher, supervised_count, ttt_loss
from eaglekit.train.metrics import Tally
from eaglekit.train.runguard import OutputDirLock, TrainError, exit_with_launcher

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TTTModel(nn.Module):
    """The head plus its loss in one forward, so DDP / DeepSpeed see every use of the parameters."""

    def __init__(self, head, teacher: Teacher, cfg: TrainConfig):
        super().__init__()
        self.head = head
        self.__dict__["teacher"] = teacher  # frozen target tensors: not parameters, not saved
        self.__dict__["cfg"] = cfg

    def forward(self, input_ids, loss_mask, feats, last, steps: int, noise: float, top=None):
        from eaglekit.heads import HeadCache, ttt_mask

        lc = self.cfg.loss
        batch = {"input_ids": input_ids, "loss_mask": loss_mask, "feats": feats, "last": last, "top": top}
        return ttt_loss(self.head, self.teacher, batch, steps=steps, decay=lc.step_decay, chunk=lc.chunk_tokens,
                        kind=self.cfg.head.kind, feature_weight=lc.feature_weight, token_weight=lc.token_weight,
                        noise=noise, mask_fn=ttt_mask, cache_cls=HeadCache, cache_teacher_mb=lc.cache_teacher_mb)


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


@torch.no_grad()
def init_from_target(head, target) -> None:
    """Warm start: the head's lm_head = the target's rows for the draft vocab, its norm = the target's
    final norm. The head then only has to learn to produce the target's pre-norm last hidden state, which
    shortens training a lot when data or compute is small (CPU)."""
    head.init_lm_head_from_target()
    norm_w = getattr(target.norm, "weight", None)
    if norm_w is not None and norm_w.shape == head.norm.weight.shape:
        head.norm.weight.copy_(norm_w.to(head.norm.weight))


@contextlib.contextmanager
def no_zero3_partitioning():
    """Hide Accelerate's ZeRO-3 config from transformers while loading the target: otherwise
    ``from_pretrained`` partitions the frozen weights (lm_head of shape [0]) whatever zero3_init_flag says."""
    try:
        import transformers.integrations.deepspeed as hf_ds
    except ImportError:
        yield
        return
    saved = getattr(hf_ds, "_hf_deepspeed_config_weak_ref", None)
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


def make_accelerator(cfg: TrainConfig):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    handlers = [InitProcessGroupKwargs(backend="gloo")] if launched and not torch.cuda.is_available() else []
    trackers = [t for t in cfg.trackers if _tracker_available(t)]
    acc = Accelerator(gradient_accumulation_steps=cfg.optim.grad_accum,
                      mixed_precision="bf16" if cfg.optim.bf16 else "no", log_with=trackers or None,
                      project_dir=cfg.output_dir, kwargs_handlers=handlers, step_scheduler_with_optimizer=False)
    if acc.state.deepspeed_plugin is not None:  # no dataloader goes through prepare: say the sizes here
        ds = acc.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = cfg.data.batch_size
        ds["train_batch_size"] = cfg.data.batch_size * cfg.optim.grad_accum * acc.num_processes
        ds["gradient_accumulation_steps"] = cfg.optim.grad_accum
        ds["gradient_clipping"] = cfg.optim.grad_clip
    return acc


def _tracker_available(name: str) -> bool:
    from accelerate.utils import is_tensorboard_available, is_wandb_available

    ok = {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available}.get(name, lambda: True)()
    if not ok:
        print(f"[eaglekit.train] tracker {name!r} is not installed; logging to log.jsonl only")
    return ok


class Trainer:
    def __init__(self, cfg: TrainConfig):
        exit_with_launcher()  # a worker of accelerate launch / torchrun dies with its launcher
        self.cfg = cfg
        self.acc = make_accelerator(cfg)
        self.out = Path(cfg.output_dir)
        self.log_path = self.out / "log.jsonl"
        self.lock = self._lock_output_dir()
        try:
            self._setup(cfg)
        except BaseException:
            self.lock.release()
            raise

    def _lock_output_dir(self) -> OutputDirLock:
        """The main process locks ``output_dir`` for the run; every rank learns whether it could."""
        lock, error = OutputDirLock(self.out), None
        if self.acc.is_main_process:
            try:
                lock.acquire()
            except TrainError as e:
                error = e
        if self._reduce([float(error is not None)])[0]:
            raise error or TrainError(f"output_dir {self.out} is in use by another run", quiet=True)
        return lock

    def _setup(self, cfg: TrainConfig) -> None:
        from accelerate.utils import set_seed

        from eaglekit.heads import HeadConfig, build_head
        from eaglekit.target import load_target
        from eaglekit.train.sources import build_sources

        set_seed(cfg.seed)
        with no_zero3_partitioning():  # the frozen target stays whole on every rank under ZeRO-3
            self.target = load_target(cfg.target, dtype=DTYPES[cfg.target_dtype], device=self.acc.device)
        self.src = build_sources(cfg, self.target)
        h = cfg.head
        start = self._start_head(h.init_from) if h.init_from else None
        hc = HeadConfig.from_target(self.target, kind=h.kind, num_layers=h.num_layers,
                                    draft_vocab_size=(self.src.d2t.numel() if self.src.d2t is not None else None),
                                    aux_layer_ids=list(self.src.layer_ids) or None)
        self.head = build_head(hc, self.target, dtype=torch.float32)
        if self.src.d2t is not None:
            self.head.set_draft_vocab(self.src.d2t, self.src.t2d)
        if start is not None:
            self.head.load_state_dict(start.state_dict())
        elif h.kind == "eagle3" and h.init_from_target:
            init_from_target(self.head, self.target)
        self.teacher = Teacher.build(self.target.lm_head.weight, self.src.t2d)
        o = cfg.optim
        self.total_steps, self.plans = self._plan_steps()
        warmup = o.warmup_steps or int(o.warmup_ratio * self.total_steps)
        model = TTTModel(self.head, self.teacher, cfg)
        opt = torch.optim.AdamW(self.head.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        self.state = TrainState()
        spent = (lambda: self.state.seconds / (60 * o.max_minutes)) if o.max_minutes > 0 else None
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(self.total_steps, warmup, o.min_lr_ratio, spent))
        self.model, self.opt = self.acc.prepare(model, opt)

    def _start_head(self, path: str):
        """A saved head to start from; its draft vocabulary replaces the data's (the rows must match)."""
        from eaglekit.heads import load_head

        head = load_head(path, self.target, dtype=torch.float32, device="cpu")
        c, h, taps = head.config, self.cfg.head, list(self.src.layer_ids)
        theirs = {"kind": c.kind, "num_layers": c.num_layers, "aux_layer_ids": list(c.aux_layer_ids or [])}
        ours = {"kind": h.kind, "num_layers": h.num_layers, "aux_layer_ids": taps if c.kind == "eagle3" else []}
        if theirs != ours:
            raise ValueError(f"head.init_from={path}: the saved head has {theirs}, this run wants {ours}")
        if c.kind == "eagle3":
            self.src.d2t, self.src.t2d = head.d2t.cpu(), head.t2d.cpu()
        return head

    # ---- data ------------------------------------------------------------------------------------
    def _schedule(self, epoch: int) -> Schedule:
        d = self.cfg.data
        plan = plan_micro_batches(self.src.train.lengths, d.batch_size, d.max_tokens, d.bucket_pool,
                                  self.cfg.seed, epoch)
        return Schedule(plan, self.acc.num_processes, self.acc.process_index, self.cfg.optim.grad_accum)

    def _plan_steps(self) -> tuple[int, list[int]]:
        o = self.cfg.optim
        per_epoch = [self._schedule(e).steps for e in range(max(1, o.epochs))]
        if per_epoch[0] == 0:
            raise ValueError(f"{self.src.where}: {len(self.src.train)} training samples make no whole optimizer "
                             f"step (batch {self.cfg.data.batch_size} x grad_accum {o.grad_accum} x "
                             f"{self.acc.num_processes} processes)")
        total = o.max_steps or sum(per_epoch)
        return total, per_epoch

    def _batches(self, source, micro_batches: list[list[int]]) -> list[dict]:
        return [collate(self._items(source, mb), self.cfg.head.kind) for mb in micro_batches]

    def _items(self, source, indices) -> list[dict]:
        """Fetch items and memoise the teacher's full-vocab argmax in them (kept when the source caches)."""
        items = fetch(source, indices)
        for it in items:
            if "top" not in it:
                last = it["last"].to(self.acc.device)
                it["top"] = self.teacher.targets(last[None], self.cfg.loss.chunk_tokens)[0].cpu()
        return items

    # ---- one optimizer step ----------------------------------------------------------------------
    def _reduce(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.acc.device)
        return self.acc.reduce(t, reduction="sum").tolist() if self.acc.num_processes > 1 else t.tolist()

    def train_step(self, micro_batches: list[list[int]]) -> dict:
        batches = self._batches(self.src.train, micro_batches)
        local = [supervised_count(b["loss_mask"]) for b in batches]
        tokens = sum(self.src.train.lengths[i] for mb in micro_batches for i in mb)
        count, tokens = self._reduce([sum(local), tokens])
        scale = self.acc.num_processes * self.cfg.optim.grad_accum / max(count, 1.0)
        tally, grad_norm = Tally(), None
        lc = self.cfg.loss
        noise = lc.noise if self.cfg.head.kind == "eagle1" else 0.0
        origins = [self._origins(mb, b) for mb, b in zip(micro_batches, batches)]
        self.model.train()
        for b, origin in zip(batches, origins):
            with self.acc.accumulate(self.model):
                loss_sum, stats = self.model(**self._on_device(b), steps=lc.ttt_steps, noise=noise)
                # checked before backward: under DeepSpeed the optimizer steps inside it
                stop_if_not_finite(self.acc, "loss", loss_sum, origin, self.state.step)
                self.acc.backward(loss_sum * scale)
                if self.acc.sync_gradients:
                    grad_norm = self.acc.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
                    stop_if_not_finite(self.acc, "gradient norm", grad_norm, [o for os_ in origins for o in os_],
                                       self.state.step, step_taken=checkpoints.zero_engine(self) is not None)
                self.opt.step()
                self.opt.zero_grad()
            tally.add(stats)
        total = Tally.from_list(self._reduce(tally.as_list()))
        out = {"loss": sum(total.loss) / max(count, 1.0), "supervised": count, "tokens": tokens}
        out.update({f"acc_{k}": a for k, a in enumerate(total.accuracy())})
        if grad_norm is not None:
            out["grad_norm"] = float(grad_norm)
        return out

    def _on_device(self, batch: dict) -> dict:
        """The batch's tensors on this rank's device (``origin``, a list of names, stays behind)."""
        return to_device({k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}, self.acc.device)

    def _origins(self, micro_batch: list[int], batch: dict) -> list[str]:
        """Where each sequence of a batch came from: the source's own names, else the sample numbers."""
        named = batch.get("origin")
        if named:
            return [str(o) for o in named]
        return [f"{self.src.where} sample {self.src.train.indices[i]}" for i in micro_batch]

    # ---- evaluation ------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Top-1 accuracy per TTT step and τ_sim on the held-out split (sharded across ranks)."""
        d = self.cfg.data
        steps = self.cfg.eval_ttt_steps or self.cfg.loss.ttt_steps
        order = sorted(range(len(self.src.eval)), key=lambda i: self.src.eval.lengths[i])
        mbs = [order[i:i + d.batch_size] for i in range(0, len(order), d.batch_size)]
        self.model.eval()
        tally = Tally()
        for mb in mbs[self.acc.process_index::self.acc.num_processes]:
            b = collate(self._items(self.src.eval, mb), self.cfg.head.kind)
            _, stats = self.model(**self._on_device(b), steps=steps, noise=0.0)
            tally.add(stats)
        if not tally.total:
            tally = Tally([0.0] * steps, [0.0] * steps, [0.0] * steps)
        return Tally.from_list(self._reduce(tally.as_list())).summary("eval_")

    # ---- the loop --------------------------------------------------------------------------------
    def log(self, record: dict) -> None:
        if self.acc.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        self.acc.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])

    def fit(self) -> dict:
        """Train (resuming per ``cfg.resume``), evaluate, save ``final/``; ``output_dir`` stays locked until
        this returns or raises."""
        try:
            return self._fit()
        finally:
            self.lock.release()

    def _fit(self) -> dict:
        from tqdm.auto import tqdm

        cfg = self.cfg
        self.acc.init_trackers("eaglekit", config={"output_dir": cfg.output_dir})
        changes = {} if cfg.eval_only else checkpoints.resume(self)
        bar = tqdm(total=self.total_steps, initial=self.state.step, disable=not (cfg.progress and self.acc.is_local_main_process),
                   desc="train", dynamic_ncols=True)
        t0, tok0, last_eval = time.perf_counter(), self.state.tokens, {}
        tick = t0
        while self.state.step < self.total_steps and not cfg.eval_only:
            sched = self._schedule(self.state.epoch)
            if self.state.step_in_epoch >= sched.steps:
                self.state.epoch, self.state.step_in_epoch = self.state.epoch + 1, 0
                continue
            rec = self.train_step(sched.local_step(self.state.step_in_epoch))
            tick = self._count_seconds(tick)  # before the LR update: a budget moves the schedule
            self.scheduler.step()
            rec["lr"] = self.scheduler.get_last_lr()[0]  # the next step's
            self.state.step += 1
            self.state.step_in_epoch += 1
            self.state.tokens += int(rec["tokens"])
            rec.update(step=self.state.step, epoch=self.state.epoch,
                       tokens_per_s=(self.state.tokens - tok0) / max(time.perf_counter() - t0, 1e-9))
            if changes:  # the first record after a resume with resume_allow_changes=true says what changed
                rec["config_changes"], changes = changes, {}
            if cfg.eval_interval and self.state.step % cfg.eval_interval == 0 and self.state.step < self.total_steps:
                last_eval = self.evaluate()
                rec.update(last_eval)
                if self.acc.is_main_process:
                    bar.write(f"[eaglekit.train] step {self.state.step}: loss {rec['loss']:.4f} held-out "
                              + " ".join(f"{k.removeprefix('eval_')}={v:.3f}" for k, v in last_eval.items()))
            if "eval_tau_sim" in rec or self.state.step % max(1, cfg.log_interval) == 0:
                self.log(rec)
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=f"{rec.get('acc_0', 0):.2f}",
                            tau_sim=f"{last_eval.get('eval_tau_sim', float('nan')):.2f}")
            if cfg.save_interval and self.state.step % cfg.save_interval == 0:
                weights = refuse_non_finite_weights(self.acc, self._full_state(), self.state.step,
                                                    f"checkpoint step-{self.state.step}")
                checkpoints.save(self, weights)
            if self._out_of_time():
                self.acc.print(f"[eaglekit.train] optim.max_minutes={cfg.optim.max_minutes} spent at step "
                               f"{self.state.step}/{self.total_steps}: stopping early")
                break
        bar.close()
        final = self.evaluate()
        final.update(step=self.state.step, planned_steps=self.total_steps, train_seconds=time.perf_counter() - t0,
                     tokens_per_s=(self.state.tokens - tok0) / max(time.perf_counter() - t0, 1e-9),
                     peak_memory_mb=peak_memory_mb(self.acc.device), processes=self.acc.num_processes,
                     distributed_type=str(self.acc.distributed_type).split(".")[-1])
        self.log({**final, "final": True})
        self.acc.print("[eaglekit.train] held-out " + " ".join(f"{k}={v:.4g}" for k, v in final.items()
                                                                 if isinstance(v, float)))
        if cfg.eval_only:
            if self.acc.is_main_process:
                write_text(self.out / "metrics.json", json.dumps({**final, "eval_of": cfg.head.init_from}, indent=1))
        else:
            self.save_final(final)
        self.acc.end_training()
        return final

    def _count_seconds(self, since: float) -> float:
        """Add the wall time since ``since`` to ``state.seconds`` (checkpointed: a resumed run keeps its
        budget) as the mean over ranks, so every rank takes the same learning rate and stop decision."""
        now = time.perf_counter()
        if self.cfg.optim.max_minutes > 0:
            self.state.seconds += self._reduce([now - since])[0] / self.acc.num_processes
        return now

    def _out_of_time(self) -> bool:
        """True once ``optim.max_minutes`` of training (summed over resumes) are spent."""
        budget = self.cfg.optim.max_minutes
        return budget > 0 and self.state.seconds >= 60 * budget

    def save_final(self, metrics: dict) -> Path | None:
        """Gather the full head (ZeRO-3 included) and write it with ``save_pretrained`` (main process)."""
        from eaglekit.heads import build_head

        path = self.out / "final"
        state = refuse_non_finite_weights(self.acc, self._full_state(), self.state.step, str(path))
        if self.acc.is_main_process:
            head = build_head(self.head.config, self.target, dtype=torch.float32)
            head.load_state_dict({k.removeprefix("head."): v for k, v in state.items()})
            head.save_pretrained(path)
            write_text(self.out / "metrics.json", json.dumps(metrics, indent=1))
        self.acc.wait_for_everyone()
        return path


    def _full_state(self) -> dict:
        """The whole head's weights on every rank; ZeRO-3 shards are gathered (in their training dtype)."""
        plugin = self.acc.state.deepspeed_plugin
        if plugin is None or plugin.zero_stage != 3:
            return self.acc.get_state_dict(self.model)
        import deepspeed

        model = self.acc.unwrap_model(self.model)
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            return {k: v.detach().float().cpu().clone() if v.is_floating_point() else v.cpu().clone()
                    for k, v in model.state_dict().items()}


def peak_memory_mb(device) -> float:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:  # VmHWM: this process's own peak RSS (ru_maxrss can carry a parent's peak across exec)
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train(cfg: TrainConfig) -> dict:
    return Trainer(cfg).fit()
