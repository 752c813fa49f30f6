"""Measures the notebooks compute from raw results: repetition loops, n-gram diversity, timing statistics.

Everything works on plain sequences of token ids (or any hashable items) and arrays of numbers, so the
same functions serve every engine and the tests. Uncertainty comes from a percentile bootstrap (for
medians and ratios of medians) and the Wilson score interval (for rates such as "loop rate 7 of 16").
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95


# -- repetition ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loop:
    """The end of a sequence repeating what came before it."""

    repeated_fraction: float  # of the tail's n-grams, the share that already occurred earlier
    period: int | None  # tokens per cycle where the tail is exactly periodic (None for a looser loop)


def find_tail_loop(tokens: Sequence[Hashable], *, window: int = 32, n: int = 4, threshold: float = 0.5) -> Loop | None:
    """A loop at the end of `tokens`: at least `threshold` of the last `window` tokens' n-grams occurred earlier.

    Repeated n-grams at the tail rather than an exact period, because small models loop loosely: two
    alternating lines ("A place of endless wonder, / A place of endless mystery,") or a phrase with small
    variations. Calibrated on SmolLM2-135M outputs of 80 tokens: loops score 0.7-1.0 with a 32-token window
    and 4-grams, other text 0-0.3 (a list that counts up, "1. 2. 3.", scores low: every 4-gram holds a new
    number).
    """
    fraction = tail_repeated_fraction(tokens, window=window, n=n)
    if fraction is None or fraction < threshold:
        return None
    return Loop(fraction, tail_period(tokens))


def tail_repeated_fraction(tokens: Sequence[Hashable], *, window: int = 32, n: int = 4) -> float | None:
    """Of the n-grams inside the last `window` tokens, the share that occurred earlier in the sequence.

    None for a sequence too short to hold the window.
    """
    ids = _as_ids(tokens)
    if len(ids) < window + n - 1:
        return None
    grams = [tuple(g) for g in np.lib.stride_tricks.sliding_window_view(ids, n)]
    tail_start = len(grams) - (window - n + 1)
    first_seen: dict[tuple, int] = {}
    for i, gram in enumerate(grams):
        first_seen.setdefault(gram, i)
    repeated = sum(first_seen[gram] < i for i, gram in enumerate(grams[tail_start:], tail_start))
    return repeated / (len(grams) - tail_start)


def tail_period(
    tokens: Sequence[Hashable], *, max_period: int = 64, min_repeats: float = 2.0, min_span: int = 16
) -> int | None:
    """The shortest period with which the end of `tokens` repeats exactly: `min_repeats` cycles, `min_span` tokens.

    For a period p the periodic tail is the longest suffix where each token equals the one p before it,
    plus one cycle; a sequence cut off mid-cycle (by max_new_tokens) still counts. `min_span` keeps a
    closing "\n\n" from passing as a loop of period 1.
    """
    ids = _as_ids(tokens)
    for period in range(1, min(max_period, len(ids) // 2) + 1):
        same = ids[period:] == ids[:-period]
        mismatches = np.flatnonzero(~same)
        run = len(same) - (mismatches[-1] + 1 if len(mismatches) else 0)
        if run + period >= max(min_repeats * period, min_span):
            return period
    return None


def distinct_n(tokens: Sequence[Hashable], n: int) -> float:
    """Distinct n-grams over all n-grams (Li et al., 2016): 1.0 when nothing repeats, near 0 in a loop."""
    grams = ngrams(tokens, n)
    return len(set(grams)) / len(grams) if grams else float("nan")


def repeated_ngram_fraction(tokens: Sequence[Hashable], n: int) -> float:
    """The fraction of n-grams that already occurred earlier in the same sequence."""
    grams = ngrams(tokens, n)
    seen: set[tuple] = set()
    repeated = 0
    for gram in grams:
        repeated += gram in seen
        seen.add(gram)
    return repeated / len(grams) if grams else float("nan")


def ngrams(tokens: Sequence[Hashable], n: int) -> list[tuple]:
    if n < 1:
        raise ValueError(f"n={n}: an n-gram needs n >= 1")
    items = list(tokens)
    return [tuple(items[i : i + n]) for i in range(len(items) - n + 1)]


def _as_ids(tokens: Sequence[Hashable]) -> np.ndarray:
    """Token ids as an integer array; other hashables (words, characters) are numbered first."""
    items = list(tokens)
    if all(isinstance(t, (int, np.integer)) for t in items):
        return np.asarray(items, dtype=np.int64)
    numbering: dict[Hashable, int] = {}
    return np.asarray([numbering.setdefault(t, len(numbering)) for t in items], dtype=np.int64)


# -- timing and rates ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """A statistic with a confidence interval, in the unit of the data."""

    value: float
    low: float
    high: float
    n: int
    unit: str = ""

    def as_dict(self) -> dict:
        return {"value": self.value, "ci95": [self.low, self.high], "n": self.n, "unit": self.unit}

    def __str__(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        return f"{self.value:.3g}{unit} (95% CI {self.low:.3g}-{self.high:.3g}, n={self.n})"


def describe(samples: Sequence[float], unit: str = "") -> dict:
    """Median, interquartile range and extremes of timing samples, plus the median's bootstrap interval."""
    x = _finite(samples)
    q1, median, q3 = np.percentile(x, [25, 50, 75])
    interval = median_interval(x)
    return {
        "median": float(median),
        "iqr": float(q3 - q1),
        "q1": float(q1),
        "q3": float(q3),
        "min": float(x.min()),
        "max": float(x.max()),
        "median_ci95": [interval.low, interval.high],
        "n": int(len(x)),
        "unit": unit,
    }


def median_interval(samples: Sequence[float], unit: str = "", *, seed: int = 0) -> Estimate:
    """The median with a percentile-bootstrap 95% interval."""
    x = _finite(samples)
    low, high = _percentile_interval(np.median(_resample(x, seed), axis=1))
    return Estimate(float(np.median(x)), low, high, len(x), unit)


def mean_interval(samples: Sequence[float], unit: str = "", *, seed: int = 0) -> Estimate:
    """The mean with a percentile-bootstrap 95% interval: for costs where rare long waits are the point."""
    x = _finite(samples)
    low, high = _percentile_interval(_resample(x, seed).mean(axis=1))
    return Estimate(float(x.mean()), low, high, len(x), unit)


def ratio_of_medians(numerator: Sequence[float], denominator: Sequence[float], *, seed: int = 0) -> Estimate:
    """median(numerator) / median(denominator), each group resampled independently (bootstrap 95% CI)."""
    a, b = _finite(numerator), _finite(denominator)
    ratios = np.median(_resample(a, seed), axis=1) / np.median(_resample(b, seed + 1), axis=1)
    low, high = _percentile_interval(ratios)
    return Estimate(float(np.median(a) / np.median(b)), low, high, min(len(a), len(b)), "x")


def paired_difference(a: Sequence[float], b: Sequence[float], unit: str = "", *, seed: int = 0) -> Estimate:
    """mean(a - b) over paired items (the same questions under two conditions), bootstrap 95% CI over items."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or len(x) == 0:
        raise ValueError(f"paired samples need equal, non-zero lengths: got {len(x)} and {len(y)}")
    diff = x - y
    low, high = _percentile_interval(_resample(diff, seed).mean(axis=1))
    return Estimate(float(diff.mean()), low, high, len(diff), unit)


def _resample(x: np.ndarray, seed: int) -> np.ndarray:
    """BOOTSTRAP_RESAMPLES resamples of x with replacement, one per row."""
    return np.random.default_rng(seed).choice(x, size=(BOOTSTRAP_RESAMPLES, len(x)), replace=True)


def _percentile_interval(statistics: np.ndarray) -> tuple[float, float]:
    low, high = np.percentile(statistics, [50 * (1 - CONFIDENCE), 50 * (1 + CONFIDENCE)])
    return float(low), float(high)


def rate_interval(successes: int, trials: int) -> Estimate:
    """A proportion with its Wilson score 95% interval, which stays inside [0, 1] even at 0 of n or n of n."""
    if trials < 1:
        raise ValueError(f"trials={trials}: a rate needs at least one trial")
    z = 1.959963984540054  # the normal quantile for 95%
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * np.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    # at 0 of n or n of n the bound equals p in exact arithmetic; floating point can land it just past p
    return Estimate(
        p, float(min(p, max(0.0, centre - half))), float(max(p, min(1.0, centre + half))), trials, "fraction"
    )


def _finite(samples: Sequence[float]) -> np.ndarray:
    x = np.asarray(samples, dtype=float)
    x = x[np.isfinite(x)]
    if len(x) == 0:
        raise ValueError("no finite samples to summarise: every measurement failed or was missing")
    return x
