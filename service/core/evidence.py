"""Statistics behind the service's claims: correlations with bootstrap intervals, paired differences.

One definition, used by the API (from the per-step values it serves), the worker and the benchmarks,
so an outside script that recomputes a figure from the served numbers gets the same one.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# scipy.stats is imported where it is used: it is over a third of the API's start-up (about 2.4 s of CPU on
# this machine), and the API needs it only when a report is asked for.
RESAMPLES = 2000  # bootstrap resamples: the 95% bounds move by about 0.01 between seeds at this count
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Interval:
    """An estimate and its two-sided CONFIDENCE interval."""

    estimate: float
    low: float
    high: float


@dataclass(frozen=True)
class Correlation:
    """How well `x` predicts `y` over n paired points: Pearson (linear) and Spearman (rank) correlation,
    each with a paired percentile-bootstrap interval. None where it is undefined (fewer than 3 points, or a
    constant series)."""

    n: int
    pearson: Interval | None
    spearman: Interval | None


def _pearson(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    """Pearson r along `axis` (vectorised over bootstrap resamples); nan where either side is constant."""
    xc = x - x.mean(axis=axis, keepdims=True)
    yc = y - y.mean(axis=axis, keepdims=True)
    den = np.sqrt((xc * xc).sum(axis=axis) * (yc * yc).sum(axis=axis))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (xc * yc).sum(axis=axis) / den, np.nan)


def _spearman(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    """Spearman rho: Pearson r of the ranks (ties get their mean rank)."""
    from scipy import stats

    return _pearson(stats.rankdata(x, axis=axis), stats.rankdata(y, axis=axis), axis=axis)


def _interval(statistic: Callable[..., Any], *data: np.ndarray, seed: int) -> Interval | None:
    from scipy import stats

    estimate = float(statistic(*data))
    if math.isnan(estimate):
        return None
    with warnings.catch_warnings():  # a few points give degenerate resamples: handled below
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        boot = stats.bootstrap(data, statistic, paired=True, vectorized=True, n_resamples=RESAMPLES,
                               confidence_level=CONFIDENCE, method="percentile", rng=np.random.default_rng(seed))
    low, high = boot.confidence_interval
    # a resample that repeats one point is constant (nan); the percentile ignores none of them, so
    # fall back to the resamples that are defined
    if math.isnan(low) or math.isnan(high):
        dist = boot.bootstrap_distribution[~np.isnan(boot.bootstrap_distribution)]
        tail = (1 - CONFIDENCE) / 2
        low, high = np.quantile(dist, [tail, 1 - tail]) if dist.size else (math.nan, math.nan)
    return Interval(estimate, float(low), float(high))


def correlation(x: Sequence[float], y: Sequence[float], *, seed: int = 0) -> Correlation:
    """Pearson and Spearman correlation of paired x [n] and y [n], with bootstrap intervals (seeded, so
    the same points give the same interval)."""
    if len(x) != len(y):
        raise ValueError(f"x and y must be paired: {len(x)} against {len(y)} values")
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(xs) < 3:
        return Correlation(len(xs), None, None)
    return Correlation(len(xs), _interval(_pearson, xs, ys, seed=seed), _interval(_spearman, xs, ys, seed=seed))


def spearman_difference(a: Sequence[float], b: Sequence[float], y: Sequence[float], *,
                        seed: int = 0) -> Interval | None:
    """Spearman(a, y) - Spearman(b, y): does predictor a rank y better than b on the same points? The
    interval resamples the points once for both (paired), so what the two share cancels. None for fewer
    than 3 points or a constant series."""
    if not len(a) == len(b) == len(y):
        raise ValueError(f"a, b and y must be paired: {len(a)}, {len(b)} and {len(y)} values")
    if len(y) < 3:
        return None
    arrays = [np.asarray(v, dtype=np.float64) for v in (a, b, y)]

    def diff(a: np.ndarray, b: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
        out: np.ndarray = _spearman(a, y, axis=axis) - _spearman(b, y, axis=axis)
        return out

    return _interval(diff, *arrays, seed=seed)


def mean_interval(values: Sequence[float]) -> Interval | None:
    """The mean of `values` with its Student-t CONFIDENCE interval (None for fewer than 2 values). Given
    the per-pair differences of two methods run on the same seeds, this is the paired interval."""
    v = np.asarray(values, dtype=np.float64)
    if v.size < 2:
        return None
    from scipy import stats

    mean, se = float(v.mean()), float(v.std(ddof=1) / math.sqrt(v.size))
    half = float(stats.t.ppf((1 + CONFIDENCE) / 2, v.size - 1)) * se
    return Interval(mean, mean - half, mean + half)


def standard_error(values: Sequence[float]) -> float:
    """The standard error of the mean (0 for fewer than 2 values)."""
    v = np.asarray(values, dtype=np.float64)
    return float(v.std(ddof=1) / math.sqrt(v.size)) if v.size >= 2 else 0.0
