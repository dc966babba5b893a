"""bench.report.paired_bootstrap, the one bootstrap of benchmarks/ (bench_recipes, bench_tau_check,
bench_long_context): a real paired difference gets an interval without 0, paired noise one around 0, and
the same seed resamples the same items for every statistic."""
import random

from eaglekit.bench.report import paired_bootstrap


def test_decode_bench_paired_bootstrap_separates_a_difference_from_noise():
    rng = random.Random(1)
    base = [rng.gauss(2.0, 1.0) for _ in range(40)]  # items vary far more than the difference does
    better = [b + 0.2 + rng.gauss(0, 0.05) for b in base]
    noisy = [b + rng.gauss(0, 0.05) for b in base]

    def mean_diff(other):
        return lambda idx: sum(other[i] - base[i] for i in idx) / len(idx)

    d, lo, hi = paired_bootstrap(mean_diff(better), 40, 2000, seed=0)
    assert abs(d - (sum(better) - sum(base)) / 40) < 1e-12  # the statistic on every item
    assert 0 < lo < 0.2 < hi < 0.25 and lo < d < hi
    _, lo, hi = paired_bootstrap(mean_diff(noisy), 40, 2000, seed=0)
    assert lo < 0 < hi and hi - lo < 0.05  # paired: the items' own spread (1.0) cancels
    seen = [], []
    for got in seen:
        paired_bootstrap(lambda idx, got=got: got.append(idx) or 0.0, 40, 50, seed=3)
    assert seen[0] == seen[1] and len(seen[0]) == 51 and len(set(map(tuple, seen[0]))) == 51
