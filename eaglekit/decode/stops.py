"""What ends a row's generation: ``max_new_tokens``, an EOS token (kept, as transformers does), a stop string.

``Ending`` checks only what each step adds: the new tokens for EOS, and for stop strings the text of a tail
window (the new tokens and enough before them to hold the longest stop string), so a long answer is not
decoded again at every step. The cut is the same: the shortest answer whose text contains a stop string.
"""
from __future__ import annotations


class Ending:
    """One row's answer so far (``tokens``) and whether it has ended (``done``)."""

    def __init__(self, max_new: int, eos=frozenset(), stop: list[str] | None = None, tokenizer=None):
        self.max_new, self.eos, self.stop, self.tokenizer = max_new, eos, stop or [], tokenizer
        # a stop string of c characters spans at most ~4c tokens (a byte-level token may decode to part of a
        # character); a few tokens more keep the window's own first characters (a word's leading space,
        # half a character) out of the part that can hold a new match
        self.window = 4 * max((len(s) for s in self.stop), default=0) + 4
        self.tokens: list[int] = []
        self.done = max_new <= 0

    def add(self, new: list[int]) -> int:
        """Append a step's emitted tokens, cut at max_new, the first EOS or the first stop string; returns
        how many were kept."""
        before = len(self.tokens)
        new = new[: self.max_new - before]
        for i, t in enumerate(new):
            if t in self.eos:
                new, self.done = new[: i + 1], True
                break
        self.tokens += new
        cut = self._stop_cut(before) if self.stop else None
        if cut is not None:
            del self.tokens[cut:]
            self.done = True
        self.done = self.done or len(self.tokens) >= self.max_new
        return len(self.tokens) - before

    def _stop_cut(self, before: int) -> int | None:
        """The shortest length past ``before`` whose text ends in a stop string, or None; decodes only a tail
        window (no stop string was in the first ``before`` tokens, or the answer would have ended)."""
        lo = max(0, before - self.window)
        if not self._has_stop(self.tokens[lo:]):
            return None
        for end in range(before + 1, len(self.tokens) + 1):
            if self._has_stop(self.tokens[max(0, min(lo, end - self.window)):end]):
                return end
        return None

    def _has_stop(self, tokens: list[int]) -> bool:
        text = self.tokenizer.decode(tokens)
        return any(s in text for s in self.stop)
