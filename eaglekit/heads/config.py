"""The head's config: what it is, its shape, and which target it was trained for (JSON-serialisable);
the two head kinds, and the check that a target is the one a head was built for."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from transformers import LlamaConfig

from eaglekit import __version__

EAGLE1, EAGLE3, PEAGLE, DFLASH, DSPARK, DFLASH2, MTP = "eagle1", "eagle3", "peagle", "dflash", "dspark", "dflash2", "mtp"
KINDS = (EAGLE1, EAGLE3, PEAGLE, DFLASH, DSPARK, DFLASH2, MTP)  # the head classes of heads.registry, by kind
READS_LAST = (EAGLE1, MTP)  # kinds that read the target's last hidden state (no taps) over its whole vocabulary
DEFAULT_BLOCK = {PEAGLE: 4, DFLASH: 8, DSPARK: 8, DFLASH2: 8}  # parallel drafters: positions one forward fills unless told
DEFAULT_MARKOV_RANK = 256  # DSpark: the rank of its previous-token bias W2(W1[x]) (speculators' default)
# DFlash 2: (conv_kernel_size, conv_group_size, selector_rank, selector_top_k) unless set: the published
# recipe's, which speculators' DFlash2SpeculatorConfig also defaults to
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
DEFAULT_DRAFT_VOCAB = 32000


def _version() -> str:
    return __version__


def target_rope(cfg) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a transformers config; scaling is None for plain RoPE.

    transformers 5 keeps both in ``rope_parameters``; older configs have ``rope_theta``/``rope_scaling``.
    """
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = float(params.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    if not params:
        params = dict(getattr(cfg, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    return theta, (params if kind != "default" else None)


def _read(config, name: str):
    """``config.name`` or None: missing, or a per-layer attribute a config refuses to read globally (Gemma 4)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' per-layer attribute errors are not AttributeErrors
        return None


def _number(value) -> int | None:
    """A config's size as one int: per-layer lists (some configs size each layer) give their largest."""
    if isinstance(value, (list, tuple)):
        value = max(value, default=None)
    return int(value) if isinstance(value, (int, float)) and value > 0 else None


def mtp_layers(config) -> int:
    """How many MTP (next-n) layers a target's config says its checkpoint ships: DeepSeek / GLM's
    ``num_nextn_predict_layers`` (transformers' ``num_mtp_layers``), Qwen3.5 / Qwen3-Next's ``mtp_num_hidden_layers``;
    0 where it names none."""
    for key in ("num_mtp_layers", "num_nextn_predict_layers", "mtp_num_hidden_layers"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


@dataclass
class HeadConfig:
    kind: str = EAGLE3
    num_layers: int = 1
    hidden_size: int = 0  # = the target's hidden size (the head is as wide as the target)
    target_vocab_size: int = 0
    draft_vocab_size: int = 0  # EAGLE-1: = target_vocab_size
    target_num_layers: int = 0
    aux_layer_ids: list[int] = field(default_factory=list)  # EAGLE-3 taps (layer inputs); [] for EAGLE-1
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False  # EAGLE-3: residual is g itself (SpecForge/SafeAILab), not norm(g)
    fc_norm: bool = False  # EAGLE 3.1: an RMSNorm per tap on the taps before fc (engines' `fc_norm`)
    norm_output: bool = False  # EAGLE 3.1: the next draft step reads the post-norm hidden state (`norm_output`)
    norm_before_fc: bool = False  # one RMSNorm over the concatenated taps before fc (`norm_before_fc`, llama.cpp)
    block_size: int = 1  # parallel drafters: positions one forward fills (eagle1/eagle3 ignore it)
    mask_token_id: int = -1  # parallel drafters: the token id fed at block positions with no known token
    # the head trains its own copy of the target's embedding (speculators' embed_requires_grad; P-EAGLE's
    # reference recipe); off, it reads the target's frozen one and saves none
    train_embedding: bool = False
    # DFlash: mask slots read a trained vector of the head's own (``mask_embedding``, started from the
    # embedding row of mask_token_id) instead of that frozen row: the published recipe's answer for a vocabulary
    # with no spare, untrained row to reserve (vLLM reads it from the export's mask_embedding.pt)
    mask_embedding: bool = False
    markov_rank: int = 0  # DSpark: rank R of its previous-token logit bias W2 (R -> Vd) . W1 (V -> R); 0 = 256
    # DFlash 2 (0 = DFLASH2_DEFAULTS): taps K and channels per kernel group of the in-block convolution,
    # rank r of the candidate selector's codebooks [V, r] and the unary candidates K it reranks
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    # MTP: the target's (text) config as a dict: its MTP layers are decoder layers of the target's own class
    target_config: dict | None = None
    mtp_block: str = ""  # MTP: the target's decoder-layer class, "module:Class" (an MTP layer's block is one)
    mtp_rotary: str = ""  # MTP: the target's rotary-embedding class ("": none), built from target_config
    target_name: str = ""
    target_fingerprint: str = ""
    eaglekit_version: str = field(default_factory=_version)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"HeadConfig.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.num_layers < 1:
            raise ValueError(f"HeadConfig.num_layers must be >= 1, got {self.num_layers}")
        if int(self.block_size) < 1:
            raise ValueError(f"HeadConfig.block_size must be >= 1, got {self.block_size}")
        self.block_size = int(self.block_size)
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        if self.kind in READS_LAST and (self.fc_norm or self.norm_output or self.norm_before_fc):
            raise ValueError(f"HeadConfig: fc_norm / norm_output / norm_before_fc need fused taps; an {self.kind} "
                             "head has none")
        if self.kind == MTP and not self.target_config:
            raise ValueError("HeadConfig: an mtp head needs target_config (its layers are the target's own decoder "
                             "layers): make it with HeadConfig.from_target(target, kind='mtp')")
        if self.fc_norm and self.norm_before_fc:  # speculators refuses the pair too: two norms of the same taps
            raise ValueError("HeadConfig: fc_norm (a norm per tap) and norm_before_fc (one norm over all taps) "
                             "exclude each other; set one")
        if self.kind in READS_LAST:
            self.draft_vocab_size = self.target_vocab_size
            self.aux_layer_ids = []
        if self.train_embedding and self.kind not in (EAGLE3, PEAGLE):
            raise ValueError(f"HeadConfig.train_embedding is an EAGLE-3 / P-EAGLE option (their exports carry an "
                             f"embedding); a {self.kind} head reads the target's")
        if self.mask_embedding and self.kind != DFLASH:
            raise ValueError(f"HeadConfig.mask_embedding is a DFlash option (vLLM's DFlash loader reads it; its DSpark "
                             f"and the other kinds fill mask slots from the vocabulary); a {self.kind} head has none")
        self.markov_rank = int(self.markov_rank) or (DEFAULT_MARKOV_RANK if self.kind == DSPARK else 0)
        if self.markov_rank < 0 or (self.markov_rank and self.kind != DSPARK):
            raise ValueError(f"HeadConfig.markov_rank is DSpark's (a rank >= 1, 0 = {DEFAULT_MARKOV_RANK}); got "
                             f"{self.markov_rank} for a {self.kind} head")
        for key, default in DFLASH2_DEFAULTS.items():
            value = int(getattr(self, key)) or (default if self.kind == DFLASH2 else 0)
            if value < 0 or (value and self.kind != DFLASH2):
                raise ValueError(f"HeadConfig.{key} is DFlash 2's (>= 1, 0 = {default}); got {value} for a "
                                 f"{self.kind} head")
            setattr(self, key, value)

    @classmethod
    def from_target(cls, target, kind: str = EAGLE3, num_layers: int = 1, draft_vocab_size: int | None = None,
                    aux_layer_ids=None, block_size: int | None = None, **overrides) -> HeadConfig:
        """A head shaped like one of the target's decoder layers (heads, kv heads, head_dim, MLP, RoPE).
        ``block_size``: a parallel drafter's block (default ``DEFAULT_BLOCK`` of its kind; 1 otherwise)."""
        tc, H = target.config, target.hidden_size
        # a target without attention heads (Mamba) or with per-layer shapes still gets a head shaped like a
        # decoder layer of its width: 64-wide heads, a 4x MLP, where the config names none
        heads = _number(_read(tc, "num_attention_heads")) or max(1, H // 64)
        head_dim = _number(_read(tc, "head_dim")) or H // heads
        theta, scaling = target_rope(tc)
        vocab = target.vocab_size
        if kind not in READS_LAST:  # every kind but EAGLE-1 and MTP reads taps and predicts over a draft vocabulary
            default = target.default_taps
            if kind == DFLASH and hasattr(target, "attention_taps"):  # on a hybrid: attention layers' outputs
                default = target.attention_taps(default)
            aux = list(aux_layer_ids if aux_layer_ids is not None else default)
            # DFlash 2's candidate selector scores the whole vocabulary: its default is the target's
            full = kind == DFLASH2
            dv = draft_vocab_size if draft_vocab_size is not None else vocab if full else min(DEFAULT_DRAFT_VOCAB, vocab)
        else:
            aux, dv = [], vocab
        cfg = {
            "kind": kind, "num_layers": num_layers, "hidden_size": H, "target_vocab_size": vocab,
            "draft_vocab_size": dv, "target_num_layers": target.num_layers, "aux_layer_ids": aux,
            "num_attention_heads": heads,
            "num_key_value_heads": _number(_read(tc, "num_key_value_heads")) or heads, "head_dim": head_dim,
            "intermediate_size": _number(_read(tc, "intermediate_size")) or 4 * H,
            "rms_norm_eps": float(_read(tc, "rms_norm_eps") or 1e-6),
            "rope_theta": theta, "rope_scaling": scaling,
            "max_position_embeddings": getattr(tc, "max_position_embeddings", 2048),
            "target_name": getattr(target, "name", ""), "target_fingerprint": target.fingerprint()}
        if kind == MTP:  # as many MTP layers as the target ships (1 where its config names none)
            cfg["num_layers"] = num_layers if num_layers != 1 else mtp_layers(tc) or 1
            cfg["target_config"] = json.loads(tc.to_json_string(use_diff=False))  # as it saves and reloads
            for key, module in (("mtp_block", target.layers[-1]), ("mtp_rotary", getattr(target.decoder, "rotary_emb", None))):
                if module is not None:
                    cfg[key] = f"{type(module).__module__}:{type(module).__qualname__}"
        if kind in DEFAULT_BLOCK:  # a parallel drafter: its block and the token its unknown slots take
            cfg["block_size"] = block_size or DEFAULT_BLOCK[kind]
            cfg["mask_token_id"] = default_mask_token(target, kind)
        cfg.update(overrides)
        return cls(**cfg)

    def validate(self) -> None:
        if self.kind not in READS_LAST:
            if not 0 < self.draft_vocab_size <= self.target_vocab_size:
                raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..{self.target_vocab_size}")
            bad = [i for i in self.aux_layer_ids if not 0 <= i < self.target_num_layers]
            if not self.aux_layer_ids or bad:
                raise ValueError(f"aux_layer_ids {self.aux_layer_ids} must be non-empty layer indices "
                                 f"< target_num_layers={self.target_num_layers}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "config") -> HeadConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{where}: unknown head config key(s) {unknown}")
        return cls(**data)

    def rope_parameters(self) -> dict:
        return {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}

    def llama_config(self, **extra):
        """The head's decoder shape as a transformers LlamaConfig (RoPE init, export configs)."""
        return LlamaConfig(
            hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, intermediate_size=self.intermediate_size, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, vocab_size=self.target_vocab_size,
            rope_parameters=self.rope_parameters(), tie_word_embeddings=False, **extra)


def default_mask_token(target, kind: str = PEAGLE) -> int:
    """The token a parallel drafter feeds where it knows none (engines read it from the export's
    ``mask_token_id``). DFlash / DSpark / DFlash 2: the first embedding row past every id the tokenizer has,
    where the checkpoint pads its vocabulary (Qwen's 151,936 rows for 151,665 tokens): the published recipe's reserved
    row, which no text ever fed. Otherwise, and for P-EAGLE (whose slots read a trained ``mask_hidden``
    beside it): the tokenizer's pad token, else its EOS — an embedding the target has trained; a DFlash
    head can learn its own instead (``mask_embedding``)."""
    tok = getattr(target, "tokenizer", None)
    if kind in (DFLASH, DSPARK, DFLASH2) and tok is not None:
        spare = max(tok.get_vocab().values(), default=target.vocab_size) + 1
        if spare < target.vocab_size:
            return spare
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        tid = getattr(tok, name, None)
        if isinstance(tid, int) and 0 <= tid < target.vocab_size:
            return tid
    return target.vocab_size - 1


def check_target(config: HeadConfig, target, where: str = "head") -> None:
    """Raise ValueError naming every way ``target`` differs from the one the head was built for."""
    diffs = []
    if config.hidden_size != target.hidden_size:
        diffs.append(f"hidden size: head {config.hidden_size} vs target {target.hidden_size}")
    if config.target_vocab_size != target.vocab_size:
        diffs.append(f"vocab size: head {config.target_vocab_size} vs target {target.vocab_size}")
    if config.target_num_layers != target.num_layers:
        diffs.append(f"layer count: head {config.target_num_layers} vs target {target.num_layers}")
    beyond = [i for i in config.aux_layer_ids if not 0 <= i < target.num_layers]
    if beyond:
        diffs.append(f"taps {beyond} outside the target's layers 0..{target.num_layers - 1}")
    if config.target_fingerprint and config.target_fingerprint != target.fingerprint():
        diffs.append(f"fingerprint (config + tokenizer): head {config.target_fingerprint} "
                     f"(trained for {config.target_name or '?'}) vs target {target.fingerprint()} "
                     f"({getattr(target, 'name', '?')})")
    if diffs:
        raise ValueError(f"{where}: this head was not trained for this target — " + "; ".join(diffs))
