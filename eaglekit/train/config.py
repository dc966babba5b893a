"""Typed training config: YAML + ``key=value`` overrides through ``eaglekit.config.load_config``.

Every key a run may set lives here; an unknown key is a ConfigError (no silent no-ops). The ``target:``
section is the one every job shares (``eaglekit.config.TargetSpec``; a plain name works).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from eaglekit.config import (
    Betas,
    ConfigError,
    Fraction,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    TargetSpec,
    load_config,
)
from eaglekit.heads import EAGLE3, KINDS, HeadConfig


@dataclass
class DataConfig:
    features_dir: str | None = None  # offline: a capture directory (FeatureDataset)
    conversations: str | None = None  # online: "sharegpt" (embedded) or a .json/.jsonl file of conversations
    num_conversations: NonNegInt = 0  # online: first N conversations (0 = all)
    max_length: PosInt = 2048  # online: truncate tokenized conversations to this many tokens
    cache_online: bool = True  # online: keep computed features in RAM (bf16) after the first epoch
    eval_samples: NonNegInt = 64  # held-out samples (the last N of the source), never trained on
    batch_size: PosInt = 4  # sequences per micro-batch per process
    max_tokens: NonNegInt = 0  # if > 0, micro-batches are cut so batch*padded_len <= max_tokens
    bucket_pool: PosInt = 64  # length-bucketing pool, in micro-batches (sort by length within a pool)
    draft_vocab: str | None = None  # d2t/t2d file; default: features_dir/draft_vocab.safetensors or built
    load_target_decoder: bool | None = None  # None: only where it runs (online features, head.init_layer_from_target,
    # an adapter, target.tp_size > 1); offline, the target's embedding, final norm and lm_head are read alone
    keep_target_rows: bool = True  # offline without the decoder: compute every item's teacher argmax once,
    # then keep only the embedding rows of the capture's tokens and the draft vocabulary's lm_head rows


@dataclass
class HeadSpec:
    kind: str = EAGLE3
    num_layers: PosInt = 1
    draft_vocab_size: PosInt = 32000  # EAGLE-3 only; clipped to the target vocab
    aux_layer_ids: list[NonNegInt] | None = None  # EAGLE-3 taps; default: the target's (2, N//2, N-3)
    init_from_target: bool = False  # head.init_from_target (EAGLE-3: lm_head draft rows and final norm)
    init_layer_from_target: bool = False  # EAGLE-3: its decoder layer from the target's last layer (an experiment)
    init_from: str | None = None  # a saved head (folder or export): start from its weights and draft vocab
    fc_norm: bool = False  # EAGLE 3.1: an RMSNorm per tap before fc (docs/training.md "EAGLE 3.1")
    norm_output: bool = False  # EAGLE 3.1: each draft step reads the previous step's post-norm hidden state
    norm_before_fc: bool = False  # one RMSNorm over the concatenated taps before fc (what llama.cpp serves)
    block_size: NonNegInt = 0  # parallel drafters (peagle, dflash): positions one forward fills; 0 = the kind's default
    markov_rank: NonNegInt = 0  # DSpark: rank of its previous-token logit bias; 0 = 256 (speculators' default)
    # the head's MLP width; 0 = the target's. On a CPU each drafted token reads the whole head, so a narrower
    # MLP is a cheaper draft (configs/qwen2.5-coder-1.5b-eagle3-llama-cpp.yaml)
    intermediate_size: NonNegInt = 0
    # DFlash 2 (0 = the published recipe's 2, 16, 256, 16): the in-block convolution's taps and channels per
    # kernel group, the candidate selector's codebook rank and the unary candidates it reranks
    conv_kernel_size: NonNegInt = 0
    conv_group_size: NonNegInt = 0
    selector_rank: NonNegInt = 0
    selector_top_k: NonNegInt = 0
    # EAGLE-3 / P-EAGLE: train the head's own copy of the target's embedding (P-EAGLE's reference recipe,
    # speculators' embed_requires_grad); V x H more weights to train, save and export
    train_embedding: bool = False
    # DFlash: mask slots read a trained vector instead of the frozen embedding row of the mask token (the
    # published recipe where the vocabulary has no spare row; exported for vLLM as mask_embedding.pt)
    mask_embedding: bool = False


@dataclass
class OptimConfig:
    lr: NonNegFloat = 1e-4  # 0: the head does not move (e.g. to score a starting point)
    weight_decay: NonNegFloat = 0.0
    betas: Betas = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: NonNegInt = 0
    warmup_ratio: Fraction = 0.02  # used when warmup_steps == 0
    min_lr_ratio: Fraction = 0.0  # cosine decays to lr * min_lr_ratio
    grad_clip: PosFloat = 0.5
    grad_accum: PosInt = 1
    epochs: PosInt = 1
    max_steps: NonNegInt = 0  # optimizer steps; 0 = epochs * steps_per_epoch
    bf16: bool = False  # autocast the head in bf16 (weights and optimizer stay fp32)
    max_minutes: NonNegFloat = 0  # wall-clock budget (kept across resumes): the cosine follows steps or time, whichever
    # is further, so the run ends annealed; then it stops, evaluates and saves the final head (0 = none)


@dataclass
class LossConfig:
    ttt_steps: PosInt = 7  # training-time-test unroll K (EAGLE-1's published recipe is K=1)
    step_decay: NonNegFloat = 0.8  # weight of TTT step k is decay**k
    feature_weight: NonNegFloat = 1.0  # EAGLE-1: SmoothL1(feature)
    token_weight: NonNegFloat = 0.1  # EAGLE-1: soft CE against the target distribution
    noise: NonNegFloat = 0.1  # EAGLE-1: feature noise U(-noise, noise) (scaled like EAGLE's uniform noise)
    topk: NonNegInt = 0  # HASS-style top-K distillation: > 0 adds topk_weight * CE over the teacher's top-K
    topk_weight: NonNegFloat = 0.0  # (an experiment; benchmarks/RESULTS.md, "Training recipe")
    objective: Literal["kl", "lk", "lk_alpha", "lk_tv"] = "kl"  # per-position term: soft CE (kl) or an LK
    # loss on the acceptance rate (arXiv 2602.23881; docs/training.md "Training objectives")
    lk_eta: NonNegFloat = 3.0  # lk: the KL weight is exp(-lk_eta * alpha), alpha the position's acceptance
    lk_acceptance: Literal["sampled", "greedy"] = "sampled"  # the acceptance an lk objective targets: sampling
    # (alpha = sum min(p, q)) or greedy verification (the teacher's argmax as a point mass)
    anchors: PosInt = 512  # DFlash: anchor blocks drawn per sequence at most (all candidates when fewer)
    block_gamma: NonNegFloat = 0  # DFlash: block depth k weighs exp(-(k-1)/block_gamma); 0 = the paper's for the block
    block_weights_normalized: bool = False  # DFlash: those weights divided by their sum (SpecForge's CE / sum w)
    confidence_weight: NonNegFloat = 1.0  # DSpark: weight of its confidence head's BCE (speculators' alpha)
    block_weighting: Literal["decay", "dpace"] = "decay"  # DFlash/DSpark depth weights: exp(-(k-1)/gamma), or
    # D-PACE's (speculators' per_position_loss_weight=dpace): the detached expected accepted length from depth k
    dpace_alpha: Fraction = 0.5  # D-PACE: confidence smoothing s = (1 - alpha) exp(-CE) + alpha
    selector_weight: NonNegFloat = 1.0  # DFlash 2: weight alpha of its selector's CE over the top-K candidates
    selector_missing: Literal["swap", "drop"] = "swap"  # DFlash 2, a gold token outside the top-K: put at rank K
    # (speculators, SpecForge) or the position left out of the selector's CE (NeMo)
    cod_ratio: Fraction = 0.0  # P-EAGLE: > 0 = COD sampling, depth k+1 trains max(cod_ratio**k, cod_floor) of
    cod_floor: Fraction = 0.2  # the anchors (nested), each kept position weight 1; 0 = all anchors, step_decay**k
    chunk_tokens: PosInt = 512  # teacher / CE computed over this many positions at a time
    cache_teacher_mb: NonNegFloat = 64  # keep the draft-vocab teacher [B,S,Vd] fp32 per batch if it fits, else recompute
    recompute_logits: bool = False  # EAGLE-3: keep no TTT step's [B,S,Vd] logits for backward, recompute them
    # there (one more lm_head product per step; the soft CE only; not under ZeRO-3)


@dataclass
class TrainConfig:
    target: TargetSpec = field(default_factory=TargetSpec)  # its embedding, lm_head; online taps
    output_dir: str = "runs/head"
    data: DataConfig = field(default_factory=DataConfig)
    head: HeadSpec = field(default_factory=HeadSpec)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    eval_interval: NonNegInt = 100  # optimizer steps between evaluations (0 = only at the end)
    eval_ttt_steps: NonNegInt = 0  # TTT steps used for eval accuracy / tau_sim (0 = loss.ttt_steps)
    save_interval: NonNegInt = 200  # optimizer steps between checkpoints (0 = none)
    keep_last: NonNegInt = 2  # checkpoints kept
    resume: str = "auto"  # "auto" (latest checkpoint if any), "none", or a checkpoint dir
    resume_allow_changes: bool = False  # resume although the config differs from the checkpoint's (applied, logged)
    log_interval: NonNegInt = 1  # optimizer steps between log.jsonl / tracker records (eval steps always logged)
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    seed: int = 0
    progress: bool = True  # tqdm bar on the main process
    eval_only: bool = False  # evaluate head.init_from on the held-out split, write metrics.json, no training


def load_train_config(path: str | Path | None, overrides: list[str] | dict | None = None) -> TrainConfig:
    """Read and validate a training config; raises ConfigError with the file and key at fault."""
    cfg = load_config(TrainConfig, path, overrides)
    validate(cfg, where=str(path or "config"))
    return cfg


def validate(cfg: TrainConfig, where: str = "config") -> None:
    d, h, o = cfg.data, cfg.head, cfg.optim
    if h.kind not in KINDS:
        raise ConfigError(f"{where}: head.kind must be one of {KINDS}, got {h.kind!r}")
    if bool(d.features_dir) == bool(d.conversations):
        raise ConfigError(f"{where}: set exactly one of data.features_dir (offline) or data.conversations (online)")
    if cfg.resume not in ("auto", "none") and not Path(cfg.resume).is_dir():
        raise ConfigError(f"{where}: resume must be 'auto', 'none' or a checkpoint directory, got {cfg.resume!r}")
    for name, value in (("data.batch_size", d.batch_size), ("optim.grad_accum", o.grad_accum),
                        ("loss.ttt_steps", cfg.loss.ttt_steps), ("head.num_layers", h.num_layers),
                        ("loss.chunk_tokens", cfg.loss.chunk_tokens)):
        if int(value) < 1:
            raise ConfigError(f"{where}: {name} must be >= 1, got {value}")
    if h.fc_norm or h.norm_output or h.norm_before_fc:  # the head config says which kinds can take them
        try:
            HeadConfig(kind=h.kind, fc_norm=h.fc_norm, norm_output=h.norm_output, norm_before_fc=h.norm_before_fc)
        except ValueError as e:
            raise ConfigError(f"{where}: head.fc_norm / head.norm_output / head.norm_before_fc with "
                              f"head.kind={h.kind!r}: {e}") from None
    loss = cfg.loss
    for key, value, active, kinds in (("loss.cod_ratio", loss.cod_ratio, loss.cod_ratio, ("peagle",)),
                                      ("loss.block_weights_normalized", loss.block_weights_normalized,
                                       loss.block_weights_normalized, ("dflash", "dspark", "dflash2")),
                                      ("loss.confidence_weight", loss.confidence_weight, loss.confidence_weight != 1.0,
                                       ("dspark",)),
                                      ("loss.block_weighting", loss.block_weighting, loss.block_weighting != "decay",
                                       ("dflash", "dspark", "dflash2")),
                                      ("head.markov_rank", h.markov_rank, h.markov_rank, ("dspark",)),
                                      *((f"head.{k}", getattr(h, k), getattr(h, k), ("dflash2",))
                                        for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                  "selector_top_k")),
                                      ("loss.selector_weight", loss.selector_weight, loss.selector_weight != 1.0,
                                       ("dflash2",)),
                                      ("loss.selector_missing", loss.selector_missing,
                                       loss.selector_missing != "swap", ("dflash2",)),
                                      ("loss.recompute_logits", True, loss.recompute_logits, ("eagle3",))):
        if active and h.kind not in kinds:  # no silent no-op: the key belongs to one kind's objective
            raise ConfigError(f"{where}: {key}={value} is a {' / '.join(kinds)} option, but head.kind={h.kind!r}")
    if loss.recompute_logits and (loss.objective != "kl" or (loss.topk and loss.topk_weight)):
        raise ConfigError(f"{where}: loss.recompute_logits recomputes the soft CE's logits; it takes "
                          f"loss.objective=kl without loss.topk (got {loss.objective!r}, topk {loss.topk})")
    if cfg.loss.lk_acceptance != "sampled" and cfg.loss.objective == "kl":
        raise ConfigError(f"{where}: loss.lk_acceptance={cfg.loss.lk_acceptance!r} applies to the LK objectives; "
                          "set loss.objective to lk, lk_alpha or lk_tv (or leave lk_acceptance 'sampled')")
    if cfg.eval_only and not h.init_from:
        raise ConfigError(f"{where}: eval_only=true needs head.init_from=<saved head> to evaluate")
    if d.load_target_decoder is False and (d.conversations or h.init_layer_from_target):
        raise ConfigError(f"{where}: data.load_target_decoder=false, but "
                          f"{'online features' if d.conversations else 'head.init_layer_from_target'} "
                          "run the target's decoder layers: leave it unset or set it true")
    if cfg.target.device_map is not None:
        raise ConfigError(f"{where}: target.device_map={cfg.target.device_map!r} is for offline capture "
                          "(eaglekit prepare); training splits a target over processes with target.tp_size")
    if cfg.target.device is not None:
        raise ConfigError(f"{where}: target.device={cfg.target.device!r}: training puts the target on each "
                          "process's accelerator device (accelerate launch / --cpu); leave target.device unset")
