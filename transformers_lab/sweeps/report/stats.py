"""The statistics of a sweep summary: an interval over seeds that stays inside the
metric's range, a test of each choice against a baseline (paired by seed only where the
seed made the two runs alike), and the best run of a grid cell (Zoology's and MAD's "best
over learning rates")."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as scipy_stats

CONFIDENCE = 0.95
MIN_FOR_TEST = 3  # seeds a side below which no test or interval means much
EXACT_BOOTSTRAP_MAX_N = 6  # up to 6 seeds every resample is enumerated (6^6 = 46,656)
BOOTSTRAP_DRAWS = 20_000  # above, a fixed-seed Monte Carlo bootstrap


@dataclass(frozen=True)
class Interval:
    """The mean of n values and its two-sided confidence interval (None for n < 2), and
    how it was made: ``t`` (Student's) or ``bootstrap`` (percentile, over seeds)."""

    mean: float
    low: float | None
    high: float | None
    n: int
    method: str = "t"


def metric_range(name: str) -> tuple[float, float] | None:
    """The values a metric can take, where bounded: an accuracy lies in [0, 1], a BLEU
    score in [0, 100]; None for the unbounded ones (losses, perplexities, times)."""
    last = name.rsplit("/", 1)[-1].lower()
    if last.endswith(("acc", "accuracy")):
        return (0.0, 1.0)
    if last.endswith("bleu"):
        return (0.0, 100.0)
    return None


def interval(values: Sequence[float], bounds: tuple[float, float] | None) -> Interval:
    """The 95% interval of the mean of ``values`` over seeds: for a bounded metric the
    percentile bootstrap, which stays inside the values' range (a t-interval on
    accuracies of 0.28 and 0.98 runs past 1); else Student's t."""
    return t_interval(values) if bounds is None else bootstrap_interval(values)


def bootstrap_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """The percentile bootstrap interval of the mean over seeds: the mean of n values drawn
    with replacement, every one of the n^n draws for n <= 6 (exact, the same every time),
    else 20,000 draws from a fixed seed. It lies within [min, max] of the values."""
    n = len(values)
    if n == 0:
        raise ValueError("no values to take a mean of")
    mean = statistics.fmean(values)
    if n < 2:
        return Interval(mean, None, None, n, "bootstrap")
    data = np.asarray(values, dtype=np.float64)
    if n <= EXACT_BOOTSTRAP_MAX_N:
        draws = np.array(list(itertools.product(range(n), repeat=n)))
    else:
        draws = np.random.default_rng(0).integers(0, n, size=(BOOTSTRAP_DRAWS, n))
    means = data[draws].mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return Interval(mean, float(low), float(high), n, "bootstrap")


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """mean ± t_{n-1} s / sqrt(n): Student's interval for the mean of a few seeds."""
    n = len(values)
    if n == 0:
        raise ValueError("no values to take a mean of")
    mean = statistics.fmean(values)
    if n < 2:
        return Interval(mean, None, None, n)
    half = scipy_stats.t.ppf(0.5 + confidence / 2, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


@dataclass(frozen=True)
class Comparison:
    """A choice against the baseline: the difference of means, the test's name, its
    statistic and two-sided p value (None where the test cannot be made)."""

    difference: float
    test: str
    statistic: float | None
    p: float | None

    def significant(self, alpha: float = 0.05) -> bool:
        return self.p is not None and self.p < alpha


def compare(
    values: Mapping[str, float], baseline: Mapping[str, float], paired: bool = True
) -> Comparison:
    """``values`` against ``baseline`` (each keyed by seed): a paired t-test on the
    differences when ``paired`` (the caller knows the seed made each pair alike) and both
    have the same seeds (at least 2), else Welch's t-test. Two groups that do not vary at
    all are equal (p = 1) or differ surely (p = 0)."""
    a, b = list(values.values()), list(baseline.values())
    if not a or not b:
        raise ValueError("a comparison needs values on both sides")
    difference = statistics.fmean(a) - statistics.fmean(b)
    if paired and set(values) == set(baseline) and len(values) >= 2:
        diffs = [values[seed] - baseline[seed] for seed in values]
        if statistics.pstdev(diffs) == 0:
            return Comparison(difference, "paired t", None, 1.0 if diffs[0] == 0 else 0.0)
        result = scipy_stats.ttest_rel(a, [baseline[seed] for seed in values])
        return Comparison(difference, "paired t", float(result.statistic), float(result.pvalue))
    if len(a) < 2 or len(b) < 2:
        return Comparison(difference, "Welch t", None, None)
    if statistics.pstdev(a) == 0 and statistics.pstdev(b) == 0:
        return Comparison(difference, "Welch t", None, 1.0 if difference == 0 else 0.0)
    result = scipy_stats.ttest_ind(a, b, equal_var=False)
    return Comparison(difference, "Welch t", float(result.statistic), float(result.pvalue))


def best_of(values: Sequence[float | None], mode: str) -> int | None:
    """The index of the best value (``mode`` min or max), None values aside."""
    scored = [(v, i) for i, v in enumerate(values) if v is not None and not math.isnan(v)]
    if not scored:
        return None
    return (max(scored) if mode == "max" else min(scored))[1]
