"""Top-1 accuracy per TTT step and the simulated acceptance length τ_sim.

Accuracy at step k is measured on positions where the predicted token is supervised (``loss_mask``);
a position whose teacher argmax lies outside the draft vocabulary counts as a miss (decode could never
propose that token), so the figure is what greedy chain drafting would see, not an optimistic subset.
τ_sim = 1 + Σ_k Π_{j≤k} acc_j: the bonus token plus the expected accepted chain length if step k is
accepted with probability acc_k given steps < k were (TTT feeds ground-truth tokens, i.e. the accepted path).
"""
from __future__ import annotations

from dataclasses import dataclass, field


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

    def add(self, stats) -> None:
        for name in ("loss", "correct", "total"):
            mine, new = getattr(self, name), getattr(stats, name)
            if not mine:
                mine.extend([0.0] * len(new))
            for k, v in enumerate(new):
                mine[k] += float(v)

    def as_list(self) -> list[float]:
        return [*self.loss, *self.correct, *self.total]

    @classmethod
    def from_list(cls, values: list[float]) -> Tally:
        k = len(values) // 3
        return cls(list(values[:k]), list(values[k:2 * k]), list(values[2 * k:]))

    def accuracy(self) -> list[float]:
        return [c / t if t else 0.0 for c, t in zip(self.correct, self.total)]

    def summary(self, prefix: str = "") -> dict:
        acc = self.accuracy()
        out = {f"{prefix}acc_{k}": a for k, a in enumerate(acc)}
        out[f"{prefix}tau_sim"] = tau_sim(acc)
        if self.total and self.total[0]:
            out[f"{prefix}loss"] = sum(self.loss) / self.total[0]
        return out
