"""The training-time-test loss: K head steps, each scored by a soft CE against the target; a head adds its
own terms (EAGLE-1: feature noise and a SmoothL1 regression, see ``DraftHead.step_loss``).

The teacher is the target's own distribution, recomputed from the stored ``last`` hidden state (already
the final-norm output, the tensor ``lm_head`` reads) through the frozen ``lm_head`` rows of the draft
vocabulary. It is never materialised as a ``[B, S, V]`` fp32 tensor: ``teacher_argmax`` scans the full
vocabulary ``chunk`` positions at a time, and ``SoftCrossEntropy`` recomputes the draft-vocab teacher per
chunk in both forward and backward, so the loss holds only ``chunk x Vd`` floats beyond its inputs.

TTT semantics (shared with decode): head element t = (g_t, x_{t+1}) predicts x_{t+2}. At step k element t
takes token x_{t+1+k}, feature g_t (k=0) or the head's own step-(k-1) ``hidden`` at t, position id t+k,
and attends step-0 keys at indices <= t plus the step-j keys (1 <= j <= k) at index t (``heads.ttt_attention``:
no [S, (k+1)S] mask, memory linear in S). Its target is the
teacher at position t+1+k (the target's distribution over x_{t+2+k}); the position counts when
``loss_mask`` is 1 at the predicted token x_{t+2+k} (which also stops at the sequence end) and, for
the CE, when the teacher's full-vocabulary argmax lies in the draft vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from eaglekit.heads.layers import shift_left
from eaglekit.heads.ttt_attention import TTTCache

__all__ = ["OBJECTIVES", "AcceptanceLoss", "ProjectedSoftCrossEntropy", "SoftCrossEntropy", "StepStats", "TTTModel",
           "Teacher", "TeacherRows", "acceptance_loss", "dense_rows", "position_loss", "projected_soft_cross_entropy", "shift_left",
           "soft_cross_entropy", "supervised_count", "teacher_argmax", "teacher_probs", "topk_cross_entropy",
           "ttt_loss", "ttt_unroll"]

# loss.objective: "kl" = the soft CE (today's recipe); the rest are the LK losses (Samarin et al. 2026,
# arXiv 2602.23881) on the acceptance rate alpha = sum_i min(p_i, q_i); see AcceptanceLoss, docs/training.md
OBJECTIVES = ("kl", "lk", "lk_alpha", "lk_tv")
ALPHA_FLOOR = 1e-12  # lk_alpha's log never sees 0 (a row with no overlap at all)


@torch.no_grad()
def teacher_argmax(last: torch.Tensor, lm_head_weight: torch.Tensor, chunk: int = 512,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Argmax over the full target vocabulary of ``lm_head(last)`` (its ``bias`` added where it has one:
    Phi-1/1.5/2, GPT-J), ``chunk`` positions at a time."""
    flat = last.reshape(-1, last.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.long, device=last.device)
    for s in range(0, flat.shape[0], chunk):
        z = flat[s:s + chunk].to(lm_head_weight.dtype) @ lm_head_weight.T
        out[s:s + chunk] = (z if bias is None else z + bias).argmax(-1)
    return out.view(last.shape[:-1])


def _teacher_probs(hidden: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    if weight is None:  # ``hidden`` already holds the teacher probabilities (small draft vocab, cached)
        return hidden.float()
    return torch.softmax(hidden.to(weight.dtype) @ weight.T, dim=-1, dtype=torch.float32)  # no fp32 copy first


@dataclass
class TeacherRows:
    """The teacher rows a loss reads, by index instead of by copy: student row n is scored against
    ``source[at[n]]``. ``source`` [M, C] is the teacher's probabilities over the draft vocab or its hidden
    state, shared by every TTT step and depth; ``at`` (long, the student's leading shape) says which row.
    A shifted or gathered copy would be kept for backward by every step (with the teacher's probabilities
    cached, [S, Vd] fp32 each: 7 x 39 MB for Qwen2.5-1.5B at Vd 32k and 305 tokens); indices are 8 bytes a row."""
    source: torch.Tensor
    at: torch.Tensor

    @classmethod
    def shifted(cls, x: torch.Tensor, n: int) -> TeacherRows:
        """``x`` [B, S, C] read ``n`` positions ahead (``shift_left(x, n)`` without the copy; rows past the end
        read the last position: they carry weight 0)."""
        B, S = x.shape[:2]
        t = torch.arange(S, device=x.device).add(n).clamp_(max=S - 1)
        return cls(x.reshape(B * S, -1), torch.arange(B, device=x.device)[:, None] * S + t)

    @classmethod
    def gathered(cls, x: torch.Tensor, pos: torch.Tensor) -> TeacherRows:
        """``x`` [B, S, C] at positions ``pos`` [B, ...] of each row's own sequence."""
        B, S = x.shape[:2]
        return cls(x.reshape(B * S, -1), torch.arange(B, device=x.device).view(B, *[1] * (pos.dim() - 1)) * S + pos)

    def __getitem__(self, index) -> TeacherRows:
        return TeacherRows(self.source, self.at[index])

    def dense(self) -> torch.Tensor:
        """The rows themselves, [*at.shape, C] (a copy: for no-grad consumers that read every row)."""
        return self.source[self.at.reshape(-1)].view(*self.at.shape, self.source.shape[-1])


def dense_rows(teacher: torch.Tensor | TeacherRows) -> torch.Tensor:
    """A teacher tensor as given, or a ``TeacherRows``'s rows themselves (``TeacherRows.dense``)."""
    return teacher.dense() if isinstance(teacher, TeacherRows) else teacher


def _flat_teacher(student: torch.Tensor, teacher) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(student [N, Vd], teacher source [M, C], row index [N] or None = row n reads row n)."""
    student = student.reshape(-1, student.shape[-1])
    if isinstance(teacher, TeacherRows):
        return student, teacher.source, teacher.at.reshape(-1)
    return student, teacher.reshape(-1, teacher.shape[-1]), None


def _rows(hidden: torch.Tensor, at: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor:
    return hidden[idx] if at is None else hidden[at[idx]]


class SoftCrossEntropy(torch.autograd.Function):
    """``sum_n w_n * CE(softmax(hidden_n @ W.T), log_softmax(student_n))`` with a chunked, recomputed teacher.

    student [N, Vd] (grad flows), hidden [M, H] and weight [Vd, H] (frozen), row_weight [N] (0 = skipped),
    at [N] long: the teacher row of each student row (None: row n). Only rows with a nonzero weight are
    computed; the gradient is ``w_n (softmax(student_n) - p_n)``. ``weight=None`` means ``hidden`` is the
    teacher's probabilities [M, Vd] already (see ``teacher_probs``).
    """

    @staticmethod
    def forward(ctx, student, hidden, weight, row_weight, chunk: int, at=None):
        rows = row_weight.nonzero().squeeze(1)
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        for s in range(0, rows.numel(), chunk):
            idx = rows[s:s + chunk]
            p = _teacher_probs(_rows(hidden, at, idx), weight)
            logq = torch.log_softmax(student[idx].float(), dim=-1)
            total -= (row_weight[idx, None].float() * p * logq).sum()
        ctx.save_for_backward(student, hidden, weight, row_weight, rows, at)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_out):
        student, hidden, weight, row_weight, rows, at = ctx.saved_tensors
        grad = torch.zeros_like(student)
        for s in range(0, rows.numel(), ctx.chunk):
            idx = rows[s:s + ctx.chunk]
            p = _teacher_probs(_rows(hidden, at, idx), weight)
            q = torch.softmax(student[idx], dim=-1, dtype=torch.float32)  # in place below: [chunk, Vd] each
            grad[idx] = q.sub_(p).mul_(row_weight[idx, None].float() * grad_out).to(grad.dtype)
        return grad, None, None, None, None, None


def soft_cross_entropy(student, hidden, weight, row_weight, chunk: int = 512) -> torch.Tensor:
    """Weighted soft CE summed over rows; see ``SoftCrossEntropy``. Inputs may carry leading batch dims;
    ``hidden`` may be a ``TeacherRows`` (the rows by index)."""
    student, hidden, at = _flat_teacher(student, hidden)
    return SoftCrossEntropy.apply(student, hidden, weight, row_weight.reshape(-1), chunk, at)


class ProjectedSoftCrossEntropy(torch.autograd.Function):
    """``SoftCrossEntropy`` of the logits ``normed @ lm_weight.T`` that never keeps those logits for backward.

    A TTT unroll keeps one [N, Vd] fp32 logits tensor per step for the soft CE's backward (7 steps x 512
    tokens x 32k draft tokens: 0.46 GB). Here forward computes the logits ``chunk`` rows at a time (their
    argmax is returned for the stats) and backward recomputes the rows that carry weight: one more
    ``lm_head`` product per step for ``[N, Vd]`` floats never held. The gradients are the unfused ones:
    d normed = dz @ W and d W = dz.T @ normed with dz = w (softmax(z) - p). Other inputs as SoftCrossEntropy's.
    """

    @staticmethod
    def forward(ctx, normed, lm_weight, hidden, weight, row_weight, chunk: int, at=None):
        device = normed.device.type  # backward recomputes under the same autocast as this forward
        ctx.autocast = device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        pred = torch.empty(normed.shape[0], dtype=torch.long, device=normed.device)
        total = torch.zeros((), dtype=torch.float32, device=normed.device)
        for s in range(0, normed.shape[0], chunk):
            z = normed[s:s + chunk] @ lm_weight.T
            pred[s:s + chunk] = z.argmax(-1)
            w = row_weight[s:s + chunk]
            live = w.nonzero().squeeze(1)
            if live.numel():
                p = _teacher_probs(_rows(hidden, at, live + s), weight)
                total -= (w[live, None].float() * p * torch.log_softmax(z[live].float(), dim=-1)).sum()
        ctx.save_for_backward(normed, lm_weight, hidden, weight, row_weight, at)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(pred)
        return total, pred

    @staticmethod
    def backward(ctx, grad_out, _):
        normed, lm_weight, hidden, weight, row_weight, at = ctx.saved_tensors
        rows = row_weight.nonzero().squeeze(1)
        grad_in = torch.zeros_like(normed)
        grad_w = torch.zeros_like(lm_weight) if ctx.needs_input_grad[1] else None
        device, enabled, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            for s in range(0, rows.numel(), ctx.chunk):
                idx = rows[s:s + ctx.chunk]
                x = normed[idx]
                z = x @ lm_weight.T
                p = _teacher_probs(_rows(hidden, at, idx), weight)
                dz = torch.softmax(z, dim=-1, dtype=torch.float32).sub_(p)
                dz = dz.mul_(row_weight[idx, None].float() * grad_out).to(z.dtype)
                grad_in[idx] = (dz @ lm_weight).to(grad_in.dtype)
                if grad_w is not None:
                    grad_w += (dz.T @ x).to(grad_w.dtype)
        return grad_in, grad_w, None, None, None, None, None


def projected_soft_cross_entropy(normed, lm_weight, teacher_k, weight, row_weight, chunk: int = 512):
    """(weighted soft CE summed over rows, argmax of each row's logits) for logits ``normed @ lm_weight.T``;
    see ``ProjectedSoftCrossEntropy``. ``normed`` [..., H]; ``teacher_k`` as ``soft_cross_entropy`` takes it."""
    flat, hidden, at = _flat_teacher(normed, teacher_k)
    loss, pred = ProjectedSoftCrossEntropy.apply(flat, lm_weight, hidden, weight, row_weight.reshape(-1), chunk, at)
    return loss, pred.view(normed.shape[:-1])


def topk_cross_entropy(student, hidden, weight, row_weight, k: int, chunk: int = 512) -> torch.Tensor:
    """HASS's harmonized objective distillation term: ``-sum_n w_n sum_{i in topK(p_n)} p_ni log q_ni``, the
    soft CE restricted to the teacher's K most likely draft tokens (same inputs as ``soft_cross_entropy``)."""
    student, hidden, at = _flat_teacher(student, hidden)
    row_weight = row_weight.reshape(-1)
    rows = row_weight.nonzero().squeeze(1)
    total = torch.zeros((), dtype=torch.float32, device=student.device)
    for s in range(0, rows.numel(), chunk):
        idx = rows[s:s + chunk]
        top_p, top_i = _teacher_probs(_rows(hidden, at, idx), weight).topk(k, dim=-1)
        logq = torch.log_softmax(student[idx].float(), dim=-1).gather(1, top_i)
        total = total - (row_weight[idx, None].float() * top_p * logq).sum()
    return total


def _acceptance_rows(z, p, kind: str, eta: float):
    """Per-row LK loss and its gradient in the student logits ``z`` [n, Vd] for teacher probs ``p``.

    alpha = sum_i min(p_i, q_i) with q = softmax(z); with m_i = [q_i < p_i] and s = sum_i m_i q_i,
    d alpha / d z = q * (m - s) (TV's subgradient, through the softmax). The hybrid's blend weight
    lambda = exp(-eta * alpha) is a constant to the gradient (the paper's stop-gradient)."""
    logq = torch.log_softmax(z, dim=-1)
    q = logq.exp()
    low = (q < p).to(q.dtype)
    alpha = torch.minimum(p, q).sum(-1)
    d_alpha = q * (low - (low * q).sum(-1, keepdim=True))
    if kind == "lk_tv":
        return 1.0 - alpha, -d_alpha
    if kind == "lk_alpha":
        a = alpha.clamp_min(ALPHA_FLOOR)
        return -a.log(), -d_alpha / a[:, None]
    lam = torch.exp(-eta * alpha)[:, None]
    kl = torch.where(p > 0, p * (p.clamp_min(1e-30).log() - logq), torch.zeros_like(p)).sum(-1)
    value = lam[:, 0] * kl + (1.0 - lam[:, 0]) * (1.0 - alpha)
    return value, lam * (q - p) - (1.0 - lam) * d_alpha


def _chunk_teacher(hidden, weight, greedy: bool) -> torch.Tensor:
    """The teacher's probabilities for a chunk of rows, or (``greedy``) the point mass on its argmax:
    what a greedy verifier accepts. Rows whose full-vocabulary argmax is outside the draft vocabulary
    carry weight 0 upstream, so the draft-vocabulary argmax is the target's own where it counts."""
    p = _teacher_probs(hidden, weight)
    if greedy:
        p = torch.zeros_like(p).scatter_(1, p.argmax(-1, keepdim=True), 1.0)
    return p


class AcceptanceLoss(torch.autograd.Function):
    """``sum_n w_n * LK(p_n, softmax(student_n))`` with the teacher recomputed per chunk (as SoftCrossEntropy).

    ``kind``: ``lk`` (the hybrid: lambda KL(p||q) + (1 - lambda) TV(p, q), lambda = exp(-eta alpha)),
    ``lk_alpha`` (-log alpha) or ``lk_tv`` (1 - alpha = TV). ``greedy``: the teacher is the point mass
    on its argmax (acceptance under greedy verification) instead of its distribution (sampling).
    Inputs as SoftCrossEntropy's; the gradient is closed-form, so backward only recomputes the chunk.
    """

    @staticmethod
    def forward(ctx, student, hidden, weight, row_weight, chunk: int, kind: str, eta: float, greedy: bool, at=None):
        rows = row_weight.nonzero().squeeze(1)
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        for s in range(0, rows.numel(), chunk):
            idx = rows[s:s + chunk]
            p = _chunk_teacher(_rows(hidden, at, idx), weight, greedy)
            value, _ = _acceptance_rows(student[idx].float(), p, kind, eta)
            total += (row_weight[idx].float() * value).sum()
        ctx.save_for_backward(student, hidden, weight, row_weight, rows, at)
        ctx.settings = chunk, kind, eta, greedy
        return total

    @staticmethod
    def backward(ctx, grad_out):
        student, hidden, weight, row_weight, rows, at = ctx.saved_tensors
        chunk, kind, eta, greedy = ctx.settings
        grad = torch.zeros_like(student)
        for s in range(0, rows.numel(), chunk):
            idx = rows[s:s + chunk]
            p = _chunk_teacher(_rows(hidden, at, idx), weight, greedy)
            _, g = _acceptance_rows(student[idx].float(), p, kind, eta)
            grad[idx] = (g * (row_weight[idx, None].float() * grad_out)).to(grad.dtype)
        return grad, None, None, None, None, None, None, None, None


def acceptance_loss(student, hidden, weight, row_weight, kind: str = "lk", eta: float = 3.0,
                    greedy: bool = False, chunk: int = 512) -> torch.Tensor:
    """Weighted LK loss summed over rows; see ``AcceptanceLoss``. Inputs may carry leading batch dims;
    ``hidden`` may be a ``TeacherRows``."""
    if kind not in OBJECTIVES[1:]:
        raise ValueError(f"acceptance_loss: kind must be one of {OBJECTIVES[1:]}, got {kind!r}")
    student, hidden, at = _flat_teacher(student, hidden)
    return AcceptanceLoss.apply(student, hidden, weight, row_weight.reshape(-1), chunk, kind, float(eta),
                                bool(greedy), at)


def position_loss(student, teacher_k, weight, row_weight, loss) -> torch.Tensor:
    """The per-position distillation objective every head kind trains with, summed over rows weighted by
    ``row_weight``: ``loss.objective`` — the soft CE against the teacher (``kl``, the default) or an LK
    loss on the acceptance rate (``lk``, ``lk_alpha``, ``lk_tv``; ``loss.lk_eta``, ``loss.lk_acceptance``)
    — plus HASS's top-K term when ``loss.topk`` and ``loss.topk_weight`` are set. ``teacher_k`` is the
    teacher's hidden state (``weight`` = the draft-vocab rows of lm_head) or its probabilities already
    (``weight`` None), as ``soft_cross_entropy`` takes them: a tensor shaped like the student or a
    ``TeacherRows``."""
    chunk = loss.chunk_tokens
    objective = getattr(loss, "objective", "kl")
    if objective == "kl":
        ce = soft_cross_entropy(student, teacher_k, weight, row_weight, chunk)
    else:
        ce = acceptance_loss(student, teacher_k, weight, row_weight, objective, getattr(loss, "lk_eta", 3.0),
                             getattr(loss, "lk_acceptance", "sampled") == "greedy", chunk)
    topk, topk_weight = getattr(loss, "topk", 0), getattr(loss, "topk_weight", 0.0)
    if topk and topk_weight:
        ce = ce + topk_weight * topk_cross_entropy(student, teacher_k, weight, row_weight, topk, chunk)
    return ce


@torch.no_grad()
def teacher_probs(last: torch.Tensor, weight: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """Teacher probabilities over the draft vocab for every position, fp32 [.., Vd], ``chunk`` rows at a time.

    Worth it when ``Vd`` is small: one matmul per batch instead of two per TTT step.
    """
    flat = last.reshape(-1, last.shape[-1])
    out = torch.empty(flat.shape[0], weight.shape[0], dtype=torch.float32, device=last.device)
    for s in range(0, flat.shape[0], chunk):
        out[s:s + chunk] = _teacher_probs(flat[s:s + chunk], weight)
    return out.view(*last.shape[:-1], weight.shape[0])


@dataclass
class Teacher:
    """The frozen pieces of the target the loss reads: full lm_head (argmax) and its draft-vocab rows, and
    the lm_head's bias where it has one (Phi-1/1.5/2, GPT-J: the target's logits are ``last @ W.T + b``)."""
    lm_head_weight: torch.Tensor | None  # [V, H]; None once every item's argmax is known (build.keep_target_rows)
    draft_weight: torch.Tensor  # [Vd, H] = lm_head_weight[t2d]
    t2d: torch.Tensor | None  # bool [V]; None = the draft vocab is the whole target vocab (EAGLE-1)
    target_to_draft: torch.Tensor | None  # long [V]: draft id or -1
    bias: torch.Tensor | None = None  # [V]; None: an lm_head without bias (or released with lm_head_weight)
    draft_bias: torch.Tensor | None = None  # [Vd] = bias[t2d]
    _biased: tuple | None = field(default=None, repr=False)  # (key, [Vd, H + 1] = [draft_weight, draft_bias])

    @classmethod
    def build(cls, lm_head_weight: torch.Tensor, t2d: torch.Tensor | None, bias: torch.Tensor | None = None) -> Teacher:
        w = lm_head_weight.detach()
        b = None if bias is None else bias.detach()
        if t2d is None or bool(t2d.all()):
            return cls(w, w, None, None, b, b)
        t2d = t2d.to(device=w.device, dtype=torch.bool)
        to_draft = torch.full((t2d.numel(),), -1, dtype=torch.long, device=w.device)
        to_draft[t2d] = torch.arange(int(t2d.sum()), device=w.device)
        return cls(w, w[t2d].contiguous(), t2d, to_draft, b, None if b is None else b[t2d].contiguous())

    @classmethod
    def of(cls, lm_head: nn.Module, t2d: torch.Tensor | None) -> Teacher:
        """The teacher of a target's whole lm_head module: its weight and, where it has one, its bias."""
        return cls.build(lm_head.weight, t2d, getattr(lm_head, "bias", None))

    def source(self, last: torch.Tensor, chunk: int, cache_mb: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(source, weight) the per-position losses read the teacher from (``position_loss``'s ``teacher_k`` and
        ``weight``): its fp32 probabilities over the draft vocabulary when ``last``'s fit in ``cache_mb``
        (weight None), else ``last`` itself and the draft rows. A biased lm_head is read as one more input
        column, ``[last, 1]`` against ``[W, b]``, so every loss that takes (hidden, weight) adds the bias."""
        weight = self.draft_weight
        if self.draft_bias is not None:
            last = torch.cat([last, last.new_ones(*last.shape[:-1], 1)], dim=-1)
            key = (weight.data_ptr(), weight._version, self.draft_bias.data_ptr(), self.draft_bias._version)
            if self._biased is None or self._biased[0] != key:  # built once, not per batch: [Vd, H + 1]
                self._biased = key, torch.cat([weight, self.draft_bias[:, None].to(weight.dtype)], dim=1)
            weight = self._biased[1]
        if last[..., 0].numel() * weight.shape[0] * 4 <= cache_mb * 2**20:
            return teacher_probs(last, weight, chunk), None
        return last, weight

    @torch.no_grad()
    def targets(self, last: torch.Tensor, chunk: int) -> torch.Tensor:
        """Teacher argmax as a draft id per position, -1 where it falls outside the draft vocab."""
        if self.lm_head_weight is None:
            raise RuntimeError("the teacher's full lm_head was released once every item's argmax was known, "
                               "but an item came without it (data.keep_target_rows=false keeps the whole table)")
        top = teacher_argmax(last, self.lm_head_weight, chunk, self.bias)
        return top if self.target_to_draft is None else self.target_to_draft[top]


@dataclass
class StepStats:
    """Per-TTT-step sums over a micro-batch (summed across ranks for logging)."""
    loss: list[float] = field(default_factory=list)  # weighted CE (+ feature) loss sum, step k
    correct: list[int] = field(default_factory=list)  # head argmax == teacher argmax, at supervised positions
    total: list[int] = field(default_factory=list)  # supervised positions (loss_mask at the predicted token)
    chain: list[int] = field(default_factory=list)  # ... where steps 0..k were all right (see metrics.py)
    recalled: list[int] = field(default_factory=list)  # ... where a selector's top-K candidates hold the gold (DFlash 2)


def supervised_count(loss_mask: torch.Tensor) -> int:
    """Positions that step 0 learns from: element t counts when loss_mask[t + 2] is 1."""
    return int(shift_left(loss_mask, 2).sum())


def ttt_unroll(head, input_ids: torch.Tensor, g: torch.Tensor, steps: int, project: bool = True):
    """Yield ``(k, hidden, logits)`` for TTT steps k = 0..steps-1 over a whole (right-padded) batch
    (``project=False``: the lm_head's input instead of the logits, EAGLE-3's ``step(project=False)``).

    Step k: element t takes x_{t+1+k}, position t+k, and (k > 0) the head's step-(k-1) hidden as g;
    one TTTCache carries every step's keys, and its attention exposes step-0 keys <= t and the step-j
    keys at index t (``ttt_mask(S, k)``'s pattern, computed without the mask, in memory linear in S) —
    exactly what chain drafting from prefix t sees at depth k.
    """
    B, S = input_ids.shape
    cache = TTTCache()
    pos0 = torch.arange(S, device=input_ids.device).expand(B, S)
    for k in range(steps):
        step = (shift_left(input_ids, 1 + k), g, pos0 + k)
        hidden, logits = head.step(*step, cache=cache) if project else head.step(*step, cache=cache, project=False)
        yield k, hidden, logits
        g = hidden


def ttt_loss(head, teacher: Teacher, batch: dict, loss, *, steps: int | None = None, train: bool = True):
    """Unroll the head ``steps`` times (default ``loss.ttt_steps``) over a padded batch; return
    (loss_sum, StepStats).

    ``batch``: input_ids [B,S], loss_mask [B,S] (0 on padding), last [B,S,H], the tensor the head reads
    (``head.reads``: ``taps`` [B,S,L*H] or ``last``), optionally top [B,S] (``Teacher.targets``, e.g.
    memoised per sample by the trainer: the full-vocabulary argmax is the costliest part on a CPU).
    ``loss``: the loss settings (``LossConfig``: step_decay, chunk_tokens, cache_teacher_mb, and what a
    head's own terms read — EAGLE-1's noise, token_weight, feature_weight); ``train=False`` (evaluation)
    adds no noise. The caller divides ``loss_sum`` by the number of supervised positions in its global
    batch. If the fp32 teacher over the draft vocab fits in ``loss.cache_teacher_mb``, it is computed once
    per batch and shifted per step; otherwise each step recomputes it chunk by chunk (never [B, S, V]):
    ``Teacher.source``.
    """
    steps, chunk, decay = steps or loss.ttt_steps, loss.chunk_tokens, loss.step_decay
    ids, loss_mask, last = batch["input_ids"], batch["loss_mask"], batch["last"]
    source, weight = teacher.source(last, chunk, loss.cache_teacher_mb)
    g = head.training_features(batch, loss.noise if train else 0.0)
    top = batch.get("top")  # [B, S] draft id of the teacher argmax, -1 outside the draft vocab
    if top is None:
        top = teacher.targets(last, chunk)
    total_loss = torch.zeros((), device=ids.device)
    stats = StepStats()
    all_right = torch.ones_like(ids, dtype=torch.bool)
    fused = getattr(loss, "recompute_logits", False)  # steps yield the lm_head's input: logits never kept
    for k, hidden, out in ttt_unroll(head, ids, g, steps, project=not fused):
        valid = shift_left(loss_mask, 2 + k).bool()  # predicted token x_{t+2+k} is supervised (and exists)
        want = shift_left(top, 1 + k, fill=-1)  # teacher at position t+1+k
        row_w = (valid & (want >= 0)).float() * (decay ** k)
        teacher_k = TeacherRows.shifted(source, 1 + k)  # the teacher at t+1+k ([B,S,Vd] probs or [B,S,H] hidden)
        if fused:
            ce, pred = projected_soft_cross_entropy(out, head.lm_head.weight, teacher_k, weight, row_w, chunk)
        else:
            ce, pred = position_loss(out, teacher_k, weight, row_w, loss), out.detach().argmax(-1)
        step_loss = head.step_loss(ce, hidden, batch, k, valid, loss)
        total_loss = total_loss + step_loss
        with torch.no_grad():
            stats.loss.append(float(step_loss))
            right = pred == want
            all_right &= right
            stats.correct.append(int((right & valid).sum()))
            stats.total.append(int(valid.sum()))
            stats.chain.append(int((all_right & valid).sum()))
    return total_loss, stats


class TTTModel(nn.Module):
    """The head plus its loss in one forward, so DDP / DeepSpeed see every use of the parameters."""

    def __init__(self, head, teacher: Teacher, loss):
        super().__init__()
        self.head = head
        self.__dict__["teacher"] = teacher  # frozen target tensors: not parameters, not saved
        self.__dict__["loss"] = loss

    def forward(self, input_ids, loss_mask, last, taps=None, top=None, *, steps: int, train: bool = True):
        batch = {"input_ids": input_ids, "loss_mask": loss_mask, "last": last, "top": top}
        if taps is not None:
            batch["taps"] = taps
        return self.head.training_loss(self.teacher, batch, self.loss, steps=steps, train=train)
