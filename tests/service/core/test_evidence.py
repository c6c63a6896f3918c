import math

import numpy as np
import pytest
from scipy import stats

from service.core import evidence


def test_correlations_match_scipy_and_intervals_cover_them():
    rng = np.random.default_rng(3)
    x = rng.normal(size=40)
    y = 0.5 * x + rng.normal(size=40)
    y[7] = y[8]  # a tie in the ranks
    c = evidence.correlation(x, y)
    assert c.n == 40
    assert c.pearson.estimate == pytest.approx(stats.pearsonr(x, y).statistic, abs=1e-12)
    assert c.spearman.estimate == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    for iv in (c.pearson, c.spearman):
        assert -1 <= iv.low < iv.estimate < iv.high <= 1
    assert evidence.correlation(x, y) == c  # seeded: the same points give the same interval
    # a perfect linear relation: r = 1 on every resample
    perfect = evidence.correlation([1, 2, 3, 4, 5], [3, 5, 7, 9, 11])
    assert (perfect.pearson.estimate, perfect.pearson.low, perfect.pearson.high) == pytest.approx((1, 1, 1))


def test_undefined_correlations_are_none():
    assert evidence.correlation([1.0, 2.0], [2.0, 1.0]) == evidence.Correlation(2, None, None)
    assert evidence.correlation([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]).pearson is None
    with pytest.raises(ValueError, match="paired"):
        evidence.correlation([1.0, 2.0, 3.0], [1.0, 2.0])


def test_mean_interval_is_the_student_t_interval():
    d = [0.1, 0.25, -0.05, 0.3, 0.0, 0.12]
    iv = evidence.mean_interval(d)
    lo, hi = stats.t.interval(0.95, len(d) - 1, loc=np.mean(d), scale=stats.sem(d))
    assert (iv.estimate, iv.low, iv.high) == pytest.approx((np.mean(d), lo, hi))
    assert evidence.mean_interval([0.3]) is None
    assert evidence.standard_error(d) == pytest.approx(stats.sem(d)) and evidence.standard_error([1.0]) == 0.0
    assert not math.isnan(iv.low)


def test_spearman_difference_is_paired():
    rng = np.random.default_rng(5)
    y = rng.normal(size=60)
    good = y + 0.3 * rng.normal(size=60)
    worse = good + 0.4 * rng.normal(size=60)  # good's ranking plus noise of its own
    iv = evidence.spearman_difference(good, worse, y)
    expected = stats.spearmanr(good, y).statistic - stats.spearmanr(worse, y).statistic
    assert iv.estimate == pytest.approx(expected, abs=1e-12)
    # resampled together, the shared part cancels: the interval excludes zero, though each predictor's own
    # Spearman interval overlaps the other's
    assert 0 < iv.low < iv.estimate < iv.high
    c_good, c_worse = evidence.correlation(good, y).spearman, evidence.correlation(worse, y).spearman
    assert c_good.low < c_worse.high
    assert evidence.spearman_difference(good, good, y) == evidence.Interval(0.0, 0.0, 0.0)
    assert evidence.spearman_difference([1.0, 2.0], [2.0, 1.0], [1.0, 2.0]) is None
    with pytest.raises(ValueError, match="paired"):
        evidence.spearman_difference([1.0, 2.0, 3.0], [1.0, 2.0], [1.0, 2.0, 3.0])
