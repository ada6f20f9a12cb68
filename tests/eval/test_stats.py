"""95% intervals: Wilson against closed-form values, bootstrap against its definition."""
import math
import random

import pytest

from dmc.eval.stats import mean_interval, wilson_interval


@pytest.mark.parametrize("k,n,low,high", [
    (2, 4, 0.150039, 0.849961),     # symmetric: p = 1/2
    (0, 10, 0.0, 0.277533),         # p = 0 stays inside [0, 1]
    (10, 10, 0.722467, 1.0),
    (189, 210, 0.851968, 0.933660),
])
def test_wilson_known_values(k, n, low, high):
    got = wilson_interval(k, n)
    assert got == pytest.approx((low, high), abs=1e-6)


def test_wilson_half_width_at_210_examples_is_under_7_points():
    assert max(wilson_interval(k, 210)[1] - wilson_interval(k, 210)[0]
               for k in range(211)) / 2 < 0.07


def test_wilson_rejects_bad_counts():
    with pytest.raises(ValueError, match="successes <= trials"):
        wilson_interval(5, 4)


def test_mean_interval_brackets_the_mean_and_matches_a_direct_bootstrap():
    source = random.Random(1)
    values = [source.gauss(3.0, 1.0) for _ in range(20)]
    low, high = mean_interval(values, seed=7, samples=500)
    assert low < sum(values) / 20 < high
    rng = random.Random(7)
    means = sorted(sum(values[rng.randrange(20)] for _ in range(20)) / 20 for _ in range(500))
    assert (low, high) == (means[12], means[math.ceil(0.975 * 499)])
    assert mean_interval([2.0]) == (2.0, 2.0)


def test_weighted_mean_interval_matches_a_direct_weighted_bootstrap():
    """With weights, each resample's mean is sum(w_i v_i) / sum(w_i) over the drawn units (as
    evaluate_perplexity weights per-sequence NLL by scored tokens), not the plain mean."""
    source = random.Random(2)
    values = [source.gauss(3.0, 1.0) for _ in range(12)]
    weights = [source.choice([1, 5, 40, 200]) for _ in range(12)]
    low, high = mean_interval(values, weights, seed=3, samples=400)
    rng = random.Random(3)
    means = []
    for _ in range(400):
        picks = [rng.randrange(12) for _ in range(12)]
        means.append(sum(values[i] * weights[i] for i in picks)
                     / sum(weights[i] for i in picks))
    means.sort()
    assert (low, high) == (means[int(0.025 * 399)], means[math.ceil(0.975 * 399)])
    point = sum(v * w for v, w in zip(values, weights)) / sum(weights)
    assert low < point < high
