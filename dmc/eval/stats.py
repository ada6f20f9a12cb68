"""95% intervals for the numbers the evaluation prints.

* :func:`wilson_interval`: a proportion (needle accuracy) from ``k`` successes in
  ``n`` independent trials, Wilson score interval (Wilson, 1927), which stays inside [0, 1] and
  is reliable at small ``n`` and at proportions near 0 or 1, unlike the normal approximation.
* :func:`mean_interval`: a mean over independent units (per-sequence NLL, KL, top-1 agreement)
  by the percentile bootstrap over those units, with a fixed seed so a report is reproducible.
  Tokens of one sequence are not independent, so intervals resample whole sequences.
"""
from __future__ import annotations

import math
import random
from collections.abc import Sequence

Z95 = 1.959963984540054
BOOTSTRAP_SAMPLES = 2000


def wilson_interval(successes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """``(low, high)`` of the Wilson score interval for ``successes / trials``."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"wilson_interval: need 0 <= successes <= trials and trials >= 1, got "
                         f"{successes}/{trials}")
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_interval(values: Sequence[float], weights: Sequence[float] | None = None,
                  seed: int = 0, samples: int = BOOTSTRAP_SAMPLES) -> tuple[float, float]:
    """``(low, high)``: 2.5th and 97.5th percentiles of the (``weights``-weighted) mean of
    ``values`` resampled with replacement ``samples`` times. One value gives ``(v, v)``."""
    values = [float(v) for v in values]
    weights = [1.0] * len(values) if weights is None else [float(w) for w in weights]
    if not values or len(weights) != len(values):
        raise ValueError("mean_interval: need one weight per value and at least one value")
    rng = random.Random(seed)
    n = len(values)
    means = []
    for _ in range(samples):
        picks = [rng.randrange(n) for _ in range(n)]
        total = sum(weights[i] for i in picks)
        means.append(sum(values[i] * weights[i] for i in picks) / total)
    means.sort()
    return means[int(0.025 * (samples - 1))], means[int(math.ceil(0.975 * (samples - 1)))]
