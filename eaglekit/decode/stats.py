"""What one decode run measured: accepted lengths per verify forward, tree shapes, seconds per phase."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify forward (bonus incl.)
    tree_sizes: list[int] = field(default_factory=list)  # nodes verified per forward (root excluded)
    tree_depths: list[int] = field(default_factory=list)
    path_lengths: list[int] = field(default_factory=list)  # root + accepted nodes per forward, before EOS/stop cut
    new_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0  # target forward + acceptance + KV keep + the drafter's commit
    total_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean accepted length per target forward (the prefill forward is not counted)."""
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def acceptance_per_depth(self) -> list[float]:
        """Rate at depth d: P(node at depth d accepted | depth d-1 accepted and the tree reached d).

        Counted on the accepted paths before an EOS or stop string cut the step short (the cut tokens were
        accepted, not rejected)."""
        rates = []
        for d in range(1, max(self.tree_depths, default=0) + 1):
            tried = sum(1 for a, t in zip(self.path_lengths, self.tree_depths) if a >= d and t >= d)
            ok = sum(1 for a, t in zip(self.path_lengths, self.tree_depths) if a >= d + 1 and t >= d)
            rates.append(ok / tried if tried else float("nan"))
        return rates

    def depth_summary(self) -> str:
        """``acceptance_per_depth`` for people: the rates of the depths some accepted path reached, then which
        drafted depths none reached (their rate has no trials: not a failure), or "none drafted"."""
        rates = self.acceptance_per_depth
        if not rates:
            return "none drafted"
        reached = [f"{r:.2f}" for r in rates if not math.isnan(r)]  # NaN: no path reached that depth
        text = ", ".join(reached) or "-"
        unreached = len(rates) - len(reached)
        if unreached:
            first = len(reached) + 1
            span = f"depth {first}" if unreached == 1 else f"depths {first}-{len(rates)}"
            text += f" ({span} drafted, never reached: no path accepted that deep)"
        return text

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0

    def record(self, tree, path: list[int], emitted: int, draft_s: float = 0.0, verify_s: float = 0.0) -> None:
        """One verify forward: its tree, the accepted node indices, the tokens it emitted (after any EOS or
        stop cut) and the seconds spent drafting and verifying."""
        self.accept_lengths.append(emitted)
        self.path_lengths.append(len(path) + 1)
        self.tree_sizes.append(len(tree))
        self.tree_depths.append(tree.depth)
        self.draft_s += draft_s
        self.verify_s += verify_s

    def pool(self, other: DecodeStats) -> None:
        """Append ``other``'s verify steps: rates over the pooled steps are then ratios of summed counts."""
        self.accept_lengths += other.accept_lengths
        self.path_lengths += other.path_lengths
        self.tree_sizes += other.tree_sizes
        self.tree_depths += other.tree_depths

    def summary(self) -> dict:
        return {"tau": self.tau, "steps": len(self.accept_lengths), "new_tokens": self.new_tokens,
                "tokens_per_s": self.tokens_per_s, "acceptance_per_depth": self.acceptance_per_depth,
                "prefill_s": self.prefill_s, "draft_s": self.draft_s, "verify_s": self.verify_s,
                "total_s": self.total_s}


@dataclass
class BatchStats(DecodeStats):
    """A batch's run: ``rows[b]`` is row b's own ``DecodeStats`` (its accept lengths, trees, new tokens);
    the inherited lists pool every row's verify steps (so ``acceptance_per_depth`` counts them all),
    ``new_tokens`` and the seconds are the whole batch's, ``forwards`` the batched verify forwards."""

    rows: list[DecodeStats] = field(default_factory=list)
    forwards: int = 0

    @property
    def tau(self) -> float:
        """Mean over rows of each row's accepted tokens per target forward while it was live (rows that
        ended at the prefill have no forward and are left out)."""
        taus = [r.tau for r in self.rows if r.accept_lengths]
        return sum(taus) / len(taus) if taus else 0.0

    def summary(self) -> dict:
        return {**super().summary(), "forwards": self.forwards, "rows_tau": [r.tau for r in self.rows]}
