"""The statistics of a sweep summary: an interval over seeds (Student's t, clipped to the
metric's range; none below 3 seeds), a test of each choice against a baseline (paired by
seed only where the seed made the two runs alike), and the best run of a grid cell
(Zoology's and MAD's "best over learning rates")."""

from __future__ import annotations

import contextlib
import math
import statistics
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

CONFIDENCE = 0.95
MIN_FOR_TEST = 3  # seeds a side below which no test or interval means much


@dataclass(frozen=True)
class Interval:
    """The mean of n values and its two-sided confidence interval (None for n < 2), and
    how it was made: ``t`` (Student's), ``t, clipped`` (to a bounded metric's range) or
    ``none`` (too few seeds for one)."""

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
    """The 95% interval of the mean of ``values`` over seeds: Student's t, clipped to a
    bounded metric's range (``t, clipped``: a t-interval on accuracies of 0.28 and 0.98 runs
    past 1); none below ``MIN_FOR_TEST`` seeds (``none``), where no interval keeps its
    coverage: Student's of two values spans 12.7 standard errors, and a bootstrap over them
    only their range, narrower than one standard deviation."""
    n = len(values)
    spread = t_interval(values)
    if n < MIN_FOR_TEST:
        return Interval(spread.mean, None, None, n, "none")
    if bounds is None:
        return spread
    low, high = max(bounds[0], spread.low), min(bounds[1], spread.high)
    return Interval(spread.mean, low, high, n, "t, clipped")


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """mean ± t_{n-1} s / sqrt(n): Student's interval for the mean of a few seeds."""
    n = len(values)
    if n == 0:
        raise ValueError("no values to take a mean of")
    mean = statistics.fmean(values)
    if n < 2:
        return Interval(mean, None, None, n)
    from scipy import stats as scipy_stats  # here: every run builds the summary's callback

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
    from scipy import stats as scipy_stats

    a, b = list(values.values()), list(baseline.values())
    if not a or not b:
        raise ValueError("a comparison needs values on both sides")
    difference = statistics.fmean(a) - statistics.fmean(b)
    if paired and set(values) == set(baseline) and len(values) >= 2:
        diffs = [values[seed] - baseline[seed] for seed in values]
        if statistics.pstdev(diffs) == 0:
            return Comparison(difference, "paired t", None, 1.0 if diffs[0] == 0 else 0.0)
        with exact_flat_sides(diffs):
            result = scipy_stats.ttest_rel(a, [baseline[seed] for seed in values])
        return Comparison(difference, "paired t", float(result.statistic), float(result.pvalue))
    if len(a) < 2 or len(b) < 2:
        return Comparison(difference, "Welch t", None, None)
    if statistics.pstdev(a) == 0 and statistics.pstdev(b) == 0:
        return Comparison(difference, "Welch t", None, 1.0 if difference == 0 else 0.0)
    with exact_flat_sides(a, b):
        result = scipy_stats.ttest_ind(a, b, equal_var=False)
    return Comparison(difference, "Welch t", float(result.statistic), float(result.pvalue))


@contextlib.contextmanager
def exact_flat_sides(*sides: Sequence[float]) -> Iterator[None]:
    """scipy's t-tests without its warning about a side whose values are all equal
    (accuracy 1 on every seed): its variance is exactly 0, and the test is exact, but
    scipy printed "Precision loss occurred in moment calculation" into every summary.
    Where no side is flat, its warning stands (nearly equal values, really imprecise)."""
    with warnings.catch_warnings():
        if any(len(set(side)) == 1 for side in sides):
            warnings.filterwarnings("ignore", "Precision loss occurred in moment calculation")
        yield


def best_of(values: Sequence[float | None], mode: str) -> int | None:
    """The index of the best value (``mode`` min or max), None values aside."""
    scored = [(v, i) for i, v in enumerate(values) if v is not None and not math.isnan(v)]
    if not scored:
        return None
    return (max(scored) if mode == "max" else min(scored))[1]
