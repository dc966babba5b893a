"""Stop strings checked incrementally (``stops.Ending``): the same cut as decoding the whole answer at every
step (the shortest answer whose text holds a stop string), while each check decodes only a tail window."""
import random

import pytest
from helpers import tiny_tokenizer

from eaglekit.decode.stops import Ending


def whole_text_cut(tokens: list[int], stop: list[str], tokenizer) -> int | None:
    """The rule as written before: the shortest prefix whose full decode contains a stop string."""
    for i in range(1, len(tokens) + 1):
        if any(s in tokenizer.decode(tokens[:i]) for s in stop):
            return i
    return None


class Counting:
    """A tokenizer wrapper recording how many tokens each decode call got."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids):
        self.sizes.append(len(ids))
        return self.tok.decode(ids)


def check_streams(tokenizer, vocab: range, trials: int, seed: int = 0) -> int:
    """Random answers fed in random step sizes, stop strings cut out of their own text: the incremental cut
    equals the whole-text cut every time. Returns how many trials had a stop string to find."""
    rng, found = random.Random(seed), 0
    for _ in range(trials):
        tokens = [rng.choice(vocab) for _ in range(rng.randint(30, 80))]
        text = tokenizer.decode(tokens)
        at, width = rng.randrange(len(text) // 2, len(text)), rng.randint(1, 6)
        stop = [text[at:at + width].strip() or "@@", "never-there"]
        counted = Counting(tokenizer)
        end = Ending(10_000, stop=stop, tokenizer=counted)
        i = 0
        while i < len(tokens) and not end.done:
            n = rng.randint(1, 6)
            end.add(tokens[i:i + n])
            i += n
        want = whole_text_cut(tokens, stop, tokenizer)
        assert end.tokens == (tokens if want is None else tokens[:want]), (tokens, stop)
        assert end.done == (want is not None)
        # a tail window, not the whole answer: at most the window and one step's tokens per decode
        assert max(counted.sizes) <= end.window + 6
        found += want is not None
    return found


def test_decode_stop_strings_incremental_equal_whole_text_char_tokens():
    tok = tiny_tokenizer(64)
    assert check_streams(tok, range(7, 48), 200) >= 150


@pytest.mark.real
def test_decode_stop_strings_incremental_equal_whole_text_byte_level(smollm2):
    """A byte-level BPE vocabulary (SmolLM2's): multi-byte characters split over tokens, leading spaces."""
    assert check_streams(smollm2.tokenizer, range(49152), 150, seed=1) >= 100


def test_decode_ending_eos_and_max_new():
    end = Ending(5, eos={9})
    assert end.add([1, 2]) == 2 and not end.done
    assert end.add([3, 9, 4]) == 2 and end.done and end.tokens == [1, 2, 3, 9]
    end = Ending(3)
    assert end.add([1, 2, 3, 4]) == 3 and end.done and end.tokens == [1, 2, 3]


def test_acceptance_per_depth_summary_names_depths_never_reached():
    """`eaglekit generate` prints the rates of the depths some path reached, and names the drafted depths none did
    (their rate has no trials: NaN in ``acceptance_per_depth``), never a bare nan."""
    import math

    from eaglekit.decode.stats import DecodeStats

    s = DecodeStats(tree_depths=[5, 5], path_lengths=[2, 3], accept_lengths=[2, 3])
    assert s.acceptance_per_depth[:3] == [1.0, 0.5, 0.0] and all(math.isnan(r) for r in s.acceptance_per_depth[3:])
    assert s.depth_summary() == "1.00, 0.50, 0.00 (depths 4-5 drafted, never reached: no path accepted that deep)"
    assert DecodeStats(tree_depths=[2], path_lengths=[3], accept_lengths=[3]).depth_summary() == "1.00, 1.00"
    assert DecodeStats().depth_summary() == "none drafted"
