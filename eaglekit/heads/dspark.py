"""DSpark head: DFlash's block drafter plus a previous-token ("Markov") logit bias and a confidence head.

DFlash fills a block in one forward, but its slots are independent: slot k cannot know which token slot
k-1 proposed. DSpark keeps the one forward and adds, per slot, a low-rank bias keyed on the token before it:

    logits_k = DFlash's logits_k + W2 (W1[x_{k-1}])      W1: target vocab -> R (an embedding), W2: R -> Vd

While drafting, x_{k-1} is the block's known token for slot 1 and then the argmax of the previous slot's
biased logits — a chain inside the block at the cost of two small matmuls per slot, no extra forward. In
training it is the true token (teacher forcing). The confidence head predicts each slot's acceptance
probability from [hidden_k ; W1[x_{k-1}]] (one linear, a sigmoid), trained by BCE against the analytic
acceptance sum_v min(q_v, p_v) of the slot's draft distribution q and the teacher's p (detached), weighted
like the slot's distillation term; engines may cut a block where it falls below a threshold.

The layout engines read (speculators' ``dspark``, which llama.cpp's ``--spec-type draft-dspark`` converter
also reads) names these ``markov_head.markov_w1`` / ``markov_head.markov_w2`` / ``confidence_head.proj``
(eaglekit/export). Exactness does not depend on the bias: the decode loop verifies whatever a head drafts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eaglekit.heads.config import DSPARK, HeadConfig
from eaglekit.heads.dflash import DFlashHead
from eaglekit.heads.objectives import dense_rows, teacher_probs


class DSparkHead(DFlashHead):
    kind = DSPARK
    display_name, vllm_method, sglang_algorithm = "DSpark", None, None
    speculators_model = ("speculators.models.dspark", "DSparkDraftModel")
    vllm_serves = False  # vLLM 0.32.0 has no DSpark proposer: the model card points at llama.cpp instead
    llama_cpp_spec_type = "draft-dspark"  # llama-server's --spec-type for it

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        R = config.markov_rank
        self.markov_w1 = nn.Embedding(config.target_vocab_size, R)
        self.markov_w2 = nn.Linear(R, config.draft_vocab_size, bias=False)
        nn.init.zeros_(self.markov_w2.weight)  # a fresh DSpark drafts exactly as its DFlash backbone
        self.confidence = nn.Linear(config.hidden_size + R, 1)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """[.., Vd] bias of the slots whose previous tokens (target ids) are ``prev`` [..]."""
        return self.markov_w2(self.markov_w1(prev.to(self.markov_w1.weight.device)))

    def confidence_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """[..] acceptance logits (before the sigmoid) of slots with states ``hidden`` [.., H] after ``prev``."""
        return self.confidence(torch.cat([hidden, self.markov_w1(prev).to(hidden.dtype)], -1)).squeeze(-1)

    def block_draft_logits(self, hidden: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        base = self.logits(hidden)  # [B, D, Vd]
        out, prev = [], last
        for k in range(base.shape[1]):  # the chain stays on the device: no host sync
            out.append(base[:, k] + self.markov_bias(prev))
            prev = self.draft_to_target(out[-1].argmax(-1))
        return torch.stack(out, 1)

    def block_train_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden) + self.markov_bias(prev)

    def block_extra_loss(self, hidden, prev, logits, teacher_k, weight, row_w, loss, want) -> torch.Tensor:
        """``loss.confidence_weight`` x the BCE of the confidence head against each slot's acceptance rate
        sum_v min(q_v, p_v) (q the slot's draft distribution, p the teacher's; detached), summed with the
        slots' distillation weights ``row_w``."""
        alpha = float(getattr(loss, "confidence_weight", 1.0))
        if alpha == 0:
            return logits.new_zeros(())
        with torch.no_grad():
            teacher_k = dense_rows(teacher_k)  # the [B, N, D] teacher rows themselves, transient
            p = teacher_k if weight is None else teacher_probs(teacher_k, weight, loss.chunk_tokens)
            accept = torch.minimum(torch.softmax(logits.float(), -1), p.float()).sum(-1).clamp(0, 1)
        bce = F.binary_cross_entropy_with_logits(self.confidence_logits(hidden, prev).float(), accept,
                                                 reduction="none")
        return alpha * (bce * row_w).sum()
