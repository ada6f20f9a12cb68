"""dmc.eval.kv_budget: the pages a batch holds when each sequence's pages vary (the prediction
bound of a sum, checked by simulation) and the largest batch that fits a budget with it."""
import math
import statistics

import pytest
import torch

from dmc.eval.kv_budget import (
    MIN_SAMPLES,
    batch_pages_bound,
    cache_allocation,
    fit_batch,
    student_quantile,
)


def test_a_constant_sequence_gives_the_batch_times_it():
    for probed in ([40960] * 2, [40960] * 64):
        bound = batch_pages_bound(probed)
        assert [bound(b) for b in (1, 38, 137)] == [40960, 38 * 40960, 137 * 40960]


def test_few_probed_sequences_give_the_batch_times_the_largest():
    probed = [9791, 10889, 10809, 10363]  # forced DMC 4x at the GPU preset's layout (CPU probe)
    assert len(probed) < MIN_SAMPLES
    assert batch_pages_bound(probed)(137) == 137 * 10889


def test_eight_probed_sequences_are_enough_for_the_prediction_bound():
    """From 8 probed sequences on the bound is Student's, batch * m + t * s * sqrt(batch +
    batch^2 / n) with t for 7 degrees of freedom; 7 give the batch times the largest."""
    probed = [100, 101, 99, 100, 102, 98, 100, 104]
    mean, spread = statistics.fmean(probed), statistics.stdev(probed)
    want = math.ceil(50 * mean + student_quantile(3, 7) * spread * math.sqrt(50 + 50**2 / 8))
    assert batch_pages_bound(probed)(50) == want < 50 * max(probed)
    assert batch_pages_bound(probed[:7])(50) == 50 * 102


def test_many_probed_sequences_give_the_prediction_bound_of_the_sum():
    gen = torch.Generator().manual_seed(0)
    probed = (10463 + 500 * torch.randn(64, generator=gen)).round().int().tolist()
    mean, spread = statistics.fmean(probed), statistics.stdev(probed)
    bound = batch_pages_bound(probed)
    for batch in (1, 10, 137):
        assert bound(batch) == math.ceil(batch * mean + student_quantile(3, 63) * spread
                                         * math.sqrt(batch + batch**2 / 64))
    assert bound(137) < 137 * max(probed)  # tighter than the largest of 64 draws
    assert bound(137) > 137 * mean
    with pytest.raises(ValueError, match="no probed sequence"):
        batch_pages_bound([])


# The exact t quantiles at the level Phi(3) = 0.998650..., solved once with mpmath at 30 digits
# from Student's CDF 1 - I_{dof / (dof + t^2)}(dof / 2, 1 / 2) / 2 (regularised incomplete beta).
@pytest.mark.parametrize("dof, exact", [(7, 4.529973679), (10, 3.956936660), (15, 3.586423226),
                                        (31, 3.260941919), (63, 3.123517016)])
def test_student_quantile_at_three_sigma(dof, exact):
    """Against the exact quantile at the level Phi(3), within the first term the expansion
    leaves out (A&S 26.7.5's g4(3) / dof^4 = 38.6 / dof^4, about 12.9 / dof^4 of t ~ 3)."""
    assert student_quantile(3.0, dof) == pytest.approx(exact, rel=20 / dof**4)
    assert student_quantile(3.0, dof) == pytest.approx(exact, rel=5e-3)  # the docstring's 0.5%


@pytest.mark.parametrize("probed, batch", [(8, 137), (16, 137), (64, 137), (64, 20)])
def test_a_batch_rarely_holds_more_than_the_bound(probed, batch):
    """Per-sequence pages drawn from one normal law: over 4000 trials (a probe of ``probed``
    sequences, then a batch of ``batch`` new ones) the batch's total exceeds the bound from
    that probe in about 0.13% of them (z = 3, one-sided, Student's quantile for the estimated
    spread); where the batch is smaller than the probe, a bound on the mean alone would be
    exceeded far more often."""
    gen = torch.Generator().manual_seed(probed + batch)
    trials = 4000
    probes = 10463 + 500 * torch.randn(trials, probed, generator=gen, dtype=torch.float64)
    totals = (10463 + 500 * torch.randn(trials, batch, generator=gen,
                                         dtype=torch.float64)).sum(1)
    over = sum(float(total) > batch_pages_bound(p.tolist())(batch)
               for p, total in zip(probes, totals))
    assert over / trials < 0.005
    if batch < probed:  # the sum's own spread outweighs the mean's: a bound without it fails
        mean_only = sum(float(total) > batch * (float(p.mean()) + 3 * float(p.std()) / probed**0.5)
                        for p, total in zip(probes[:1000], totals[:1000]))
        assert mean_only / 1000 > 0.02


def test_fit_batch_takes_a_bound_over_the_whole_batch():
    shape = dict(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, window=12,
                 dtype=torch.float32, max_seq_len=64)
    budget = 200_000
    per_seq = fit_batch(budget, 20, 100, shape)
    assert fit_batch(budget, lambda b: 20 * b, 100, shape) == per_seq
    batch, pages = fit_batch(budget, lambda b: 18 * b + 10, 100, shape, headroom_pages=4)

    def used(b, n):
        return cache_allocation(num_pages=n, max_seqs=b, **shape)["total"] + 100 * b

    assert pages >= 18 * batch + 10 + 4 and used(batch, pages) <= budget
    assert used(batch + 1, 18 * (batch + 1) + 10 + 4) > budget


def test_a_budget_of_exactly_three_sequences_fits_three():
    """A batch fits when its cache plus state is at most (<=) the budget: a budget of exactly
    three sequences' bytes fits three, with their 60 pages; a byte less fits two."""
    shape = dict(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, window=12,
                 dtype=torch.float32, max_seq_len=64)
    exact = cache_allocation(num_pages=3 * 20, max_seqs=3, **shape)["total"] + 3 * 100
    assert fit_batch(exact, 20, 100, shape) == (3, 60)
    assert fit_batch(exact, lambda b: 20 * b, 100, shape) == (3, 60)
    assert fit_batch(exact - 1, 20, 100, shape)[0] == 2
    with_headroom = cache_allocation(num_pages=3 * 20 + 4, max_seqs=3, **shape)["total"] + 300
    assert fit_batch(with_headroom, 20, 100, shape, headroom_pages=4) == (3, 64)
