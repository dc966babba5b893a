"""The training loop: Accelerate (single process, DDP, DeepSpeed ZeRO-2/3), grad clipping and accumulation,
full-state checkpoints with ``resume=auto``, held-out τ_sim; ``train(cfg)`` assembles a run and runs it.

The parts are built beforehand (train/build.py); ``Trainer`` only runs the loop over them.

Loss normalisation: each optimizer step's loss is (sum over every supervised position of the global
batch, all ranks and micro-batches) / (their count), so 1 process with grad_accum=2 and 2 processes
with grad_accum=1 take the same step (DDP and ZeRO average over ranks, accumulation over micro-batches;
``scale`` undoes both).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eaglekit.fileio import write_text
from eaglekit.heads import build_head, save_head
from eaglekit.heads.objectives import TTTModel, supervised_count
from eaglekit.target.tensor_parallel import data_parallel
from eaglekit.timing import Stopwatch
from eaglekit.train.build import Parts, assemble, build_optimizer
from eaglekit.train.checkpoint_trainer import TrainState, resume_trainer, save_trainer, zero_engine
from eaglekit.train.config import TrainConfig
from eaglekit.train.data import collate, epoch_schedule, fetch_with_top, plan_steps, tensors_to
from eaglekit.train.evaluate import append_log, evaluate, evaluate_only, run_facts
from eaglekit.train.metrics import Tally
from eaglekit.train.nonfinite import refuse_non_finite_weights, stop_if_not_finite
from eaglekit.train.processes import reduce_sum


def progress_postfix(rec: dict, last_eval: dict) -> dict[str, str]:
    """What the progress bar shows beside a step: only figures measured so far — the step's loss and
    step-0 accuracy, and the held-out tau_sim once an evaluation has run (before it, nothing: a
    placeholder such as nan would read as a broken run)."""
    shown = {"loss": f"{rec['loss']:.3f}"}
    if "acc_0" in rec:
        shown["acc0"] = f"{rec['acc_0']:.2f}"
    if "eval_tau_sim" in last_eval:
        shown["tau_sim"] = f"{last_eval['eval_tau_sim']:.2f}"
    return shown


class Trainer:
    """Runs the loop over a run's parts: ``model`` (the head and its loss, prepared by Accelerate),
    ``optimizer`` and ``scheduler`` over the head, ``state`` (the loop position) and ``total_steps``."""

    def __init__(self, cfg: TrainConfig, parts: Parts, model, optimizer, scheduler, state: TrainState,
                 total_steps: int):
        self.cfg, self.acc, self.lock = cfg, parts.acc, parts.lock
        self.target, self.src, self.head, self.teacher = parts.target, parts.sources, parts.head, parts.teacher
        self.model, self.opt, self.scheduler, self.state = model, optimizer, scheduler, state
        self.total_steps = total_steps
        self.out = Path(cfg.output_dir)
        self.log_path = self.out / "log.jsonl"

    def _reduce(self, values: list[float]) -> list[float]:
        return reduce_sum(self.acc, values)

    def _schedule(self, epoch: int):
        world, rank = data_parallel(self.acc, self.target)
        return epoch_schedule(self.cfg, self.src.train.lengths, world, rank, epoch)

    def _batches(self, source, micro_batches: list[list[int]]) -> list[dict]:
        return [collate(fetch_with_top(source, mb, self.teacher, self.cfg.loss.chunk_tokens, self.acc.device),
                        self.head.reads) for mb in micro_batches]

    # ---- one optimizer step ----------------------------------------------------------------------
    def train_step(self, micro_batches: list[list[int]]) -> dict:
        batches = self._batches(self.src.train, micro_batches)
        local = [supervised_count(b["loss_mask"]) for b in batches]
        tokens = sum(self.src.train.lengths[i] for mb in micro_batches for i in mb)
        count, tokens = self._reduce([sum(local), tokens])
        # a TP group's processes train on the same batch: count and tokens hold it tp_size times, and so
        # does the gradient sum DDP averages over every process, so scale stays right; tokens are reported once
        tokens /= self.target.layout.tp_size
        scale = self.acc.num_processes * self.cfg.optim.grad_accum / max(count, 1.0)
        tally, grad_norm = Tally(), None
        origins = [self._origins(mb, b) for mb, b in zip(micro_batches, batches)]
        self.model.train()
        for b, origin in zip(batches, origins):
            with self.acc.accumulate(self.model):
                loss_sum, stats = self.model(**tensors_to(b, self.acc.device), steps=self.cfg.loss.ttt_steps)
                # checked before backward: under DeepSpeed the optimizer steps inside it
                stop_if_not_finite(self.acc, "loss", loss_sum, origin, self.state.step)
                self.acc.backward(loss_sum * scale)
                if self.acc.sync_gradients:
                    grad_norm = self.acc.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
                    stop_if_not_finite(self.acc, "gradient norm", grad_norm, [o for os_ in origins for o in os_],
                                       self.state.step, step_taken=zero_engine(self) is not None)
                self.opt.step()
                self.opt.zero_grad()
            tally.add(stats)
        total = Tally.from_list(self._reduce(tally.as_list()))
        out = {"loss": sum(total.loss) / max(count, 1.0), "supervised": count, "tokens": tokens}
        out.update({f"acc_{k}": a for k, a in enumerate(total.accuracy())})
        if grad_norm is not None:
            out["grad_norm"] = float(grad_norm)
        return out

    def _origins(self, micro_batch: list[int], batch: dict) -> list[str]:
        """Where each sequence of a batch came from: the source's own names, else the sample numbers."""
        named = batch.get("origin")
        if named:
            return [str(o) for o in named]
        return [f"{self.src.where} sample {self.src.train.indices[i]}" for i in micro_batch]

    def evaluate(self) -> dict:
        """Top-1 accuracy per TTT step and τ_sim on the held-out split (sharded across ranks)."""
        return evaluate(self.acc, self.model, self.head, self.teacher, self.src.eval, self.cfg,
                        data_parallel(self.acc, self.target))

    # ---- the loop --------------------------------------------------------------------------------
    def log(self, record: dict) -> None:
        append_log(self.acc, self.log_path, record)

    def fit(self) -> dict:
        """Train (resuming per ``cfg.resume``), evaluate, save ``final/``; ``output_dir`` stays locked until
        this returns or raises."""
        try:
            return self._fit()
        finally:
            self.lock.release()

    def _fit(self) -> dict:
        cfg = self.cfg
        self.acc.init_trackers("eaglekit", config={"output_dir": cfg.output_dir})
        changes = resume_trainer(self)
        bar = tqdm(total=self.total_steps, initial=self.state.step, disable=not (cfg.progress and self.acc.is_local_main_process),
                   desc="train", dynamic_ncols=True)
        watch, tok0, last_eval = Stopwatch(self.acc.device), self.state.tokens, {}
        while self.state.step < self.total_steps:
            sched = self._schedule(self.state.epoch)
            if self.state.step_in_epoch >= sched.steps:
                self.state.epoch, self.state.step_in_epoch = self.state.epoch + 1, 0
                continue
            rec = self.train_step(sched.local_step(self.state.step_in_epoch))
            self._count_seconds(watch)  # before the LR update: a budget moves the schedule
            self.scheduler.step()
            rec["lr"] = self.scheduler.get_last_lr()[0]  # the next step's
            self.state.step += 1
            self.state.step_in_epoch += 1
            self.state.tokens += int(rec["tokens"])
            rec.update(step=self.state.step, epoch=self.state.epoch,
                       tokens_per_s=(self.state.tokens - tok0) / max(watch.elapsed(), 1e-9))
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
            bar.set_postfix(progress_postfix(rec, last_eval))
            if cfg.save_interval and self.state.step % cfg.save_interval == 0:
                weights = refuse_non_finite_weights(self.acc, self._full_state(), self.state.step,
                                                    f"checkpoint step-{self.state.step}")
                save_trainer(self, weights)
            if self._out_of_time():
                self.acc.print(f"[eaglekit.train] optim.max_minutes={cfg.optim.max_minutes} spent at step "
                               f"{self.state.step}/{self.total_steps}: stopping early")
                break
        bar.close()
        final = self.evaluate()
        seconds = watch.elapsed()
        final.update(step=self.state.step, planned_steps=self.total_steps, train_seconds=seconds,
                     tokens_per_s=(self.state.tokens - tok0) / max(seconds, 1e-9), **run_facts(self.acc))
        self.log({**final, "final": True})
        self.acc.print("[eaglekit.train] held-out " + " ".join(f"{k}={v:.4g}" for k, v in final.items()
                                                                 if isinstance(v, float)))
        self.save_final(final)
        self.acc.end_training()
        return final

    def _count_seconds(self, watch: Stopwatch) -> None:
        """Add the wall time since the last lap to ``state.seconds`` (checkpointed: a resumed run keeps its
        budget) as the mean over ranks, so every rank takes the same learning rate and stop decision."""
        seconds = watch.lap()
        if self.cfg.optim.max_minutes > 0:
            self.state.seconds += self._reduce([seconds])[0] / self.acc.num_processes

    def _out_of_time(self) -> bool:
        """True once ``optim.max_minutes`` of training (summed over resumes) are spent."""
        budget = self.cfg.optim.max_minutes
        return budget > 0 and self.state.seconds >= 60 * budget

    def save_final(self, metrics: dict) -> Path | None:
        """Gather the full head (ZeRO-3 included) and write it with ``save_head`` (main process)."""
        path = self.out / "final"
        state = refuse_non_finite_weights(self.acc, self._full_state(), self.state.step, str(path))
        if self.acc.is_main_process:
            head = build_head(self.head.config, self.target, dtype=torch.float32, from_target=False)
            head.load_state_dict({k.removeprefix("head."): v for k, v in state.items()})
            save_head(head, path)
            write_text(self.out / "metrics.json", json.dumps(metrics, indent=1))
        self.acc.wait_for_everyone()
        return path

    def _full_state(self) -> dict:
        """The whole head's weights on every rank; ZeRO-3 shards are gathered (in their training dtype)."""
        plugin = self.acc.state.deepspeed_plugin
        if plugin is None or plugin.zero_stage != 3:
            return self.acc.get_state_dict(self.model)
        import deepspeed  # only under a DeepSpeed plugin (optional, heavy)

        model = self.acc.unwrap_model(self.model)
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            return {k: v.detach().float().cpu().clone() if v.is_floating_point() else v.cpu().clone()
                    for k, v in model.state_dict().items()}


def build_trainer(cfg: TrainConfig) -> Trainer:
    """Assemble ``cfg``'s run (build.py) and the loop's own parts: the planned steps, the TTT model, the
    optimizer and its schedule, prepared by Accelerate."""
    parts = assemble(cfg)
    try:
        total_steps, _ = plan_steps(cfg, parts.sources.train.lengths, data_parallel(parts.acc, parts.target)[0],
                                    parts.sources.where)
        state = TrainState()
        model = TTTModel(parts.head, parts.teacher, cfg.loss)
        opt, scheduler = build_optimizer(cfg.optim, parts.head, total_steps, state)
        model, opt = parts.acc.prepare(model, opt)
    except BaseException:
        parts.lock.release()
        raise
    return Trainer(cfg, parts, model, opt, scheduler, state, total_steps)


def train(cfg: TrainConfig) -> dict:
    """Train the head ``cfg`` describes; with ``eval_only=true`` evaluate ``head.init_from`` instead."""
    if cfg.eval_only:
        return evaluate_only(cfg)
    return build_trainer(cfg).fit()
