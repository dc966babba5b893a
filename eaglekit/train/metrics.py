"""Top-1 accuracy per TTT step and the simulated acceptance length τ_sim.

Accuracy at step k is measured on positions where the predicted token is supervised (``loss_mask``);
a position whose teacher argmax lies outside the draft vocabulary counts as a miss (decode could never
propose that token), so the figure is what greedy chain drafting would see, not an optimistic subset.
τ_sim = 1 + Σ_k Π_{j≤k} acc_j: the bonus token plus the expected accepted chain length if step k is
accepted with probability acc_k given steps < k were (TTT feeds ground-truth tokens, i.e. the accepted path).
That product treats the steps as independent (acc_k is measured over all positions, not only where steps
< k were right). τ_chain counts the joint event instead: at each position, were steps 0..k all right?
τ_chain = 1 + Σ_k P(steps 0..k right). Which one predicts decoding better is measured, not assumed
(benchmarks/bench_tau_check.py; the comparison for the H200-trained SmolLM2 head is in benchmarks/RESULTS.md,
"Does τ_sim predict decoding?").
"""
from __future__ import annotations

import resource
from dataclasses import dataclass, field

import torch


def tau_sim(acc: list[float]) -> float:
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau


@dataclass
class Tally:
    """Running sums of StepStats over micro-batches (and ranks, via ``as_list``/``from_list``)."""
    loss: list[float] = field(default_factory=list)
    correct: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    chain: list[float] = field(default_factory=list)  # positions where steps 0..k were all right
    recalled: list[float] = field(default_factory=list)  # positions whose gold is among a selector's candidates

    FIELDS = ("loss", "correct", "total", "chain", "recalled")

    def add(self, stats) -> None:
        for name in self.FIELDS:
            mine, new = getattr(self, name), getattr(stats, name)
            if not mine:
                mine.extend([0.0] * len(new))
            for k, v in enumerate(new):
                mine[k] += float(v)

    def as_list(self) -> list[float]:
        k = len(self.loss)
        pad = lambda xs: [*xs, *[0.0] * (k - len(xs))]  # kinds without chain / recall: zeros
        return [*self.loss, *self.correct, *self.total, *pad(self.chain), *pad(self.recalled)]

    @classmethod
    def from_list(cls, values: list[float]) -> Tally:
        n = len(cls.FIELDS)
        k = len(values) // n
        return cls(*(list(values[i * k:(i + 1) * k]) for i in range(n)))

    def accuracy(self) -> list[float]:
        return [c / t if t else 0.0 for c, t in zip(self.correct, self.total)]

    def summary(self, prefix: str = "", recall_depths: int = 0) -> dict:
        """acc_k, tau_sim, tau_chain, loss; with ``recall_depths`` (a head with a candidate selector: its block's
        depths) ``candidate_recall``, the share of those depths' positions whose gold is among the candidates."""
        acc = self.accuracy()
        out = {f"{prefix}acc_{k}": a for k, a in enumerate(acc)}
        out[f"{prefix}tau_sim"] = tau_sim(acc)
        out[f"{prefix}tau_chain"] = 1.0 + sum(c / t for c, t in zip(self.chain, self.total) if t)
        if self.total and self.total[0]:
            out[f"{prefix}loss"] = sum(self.loss) / self.total[0]
        if recall_depths:
            seen = sum(self.total[:recall_depths])
            out[f"{prefix}candidate_recall"] = sum(self.recalled[:recall_depths]) / seen if seen else 0.0
        return out


def peak_memory_mb(device) -> float:
    """This process's peak memory: CUDA allocations on a GPU, else its peak resident set."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:  # VmHWM: this process's own peak RSS (ru_maxrss can carry a parent's peak across exec)
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
