"""Loop detection, n-gram diversity and the interval estimates the notebooks report."""

from __future__ import annotations

import numpy as np
import pytest

from exlnb.analysis import (
    describe,
    distinct_n,
    find_tail_loop,
    median_interval,
    rate_interval,
    ratio_of_medians,
    repeated_ngram_fraction,
    tail_period,
)


def test_a_sequence_ending_in_a_repeated_phrase_is_a_loop_with_that_period():
    phrase = [11, 12, 13, 14, 15]
    tokens = list(range(100, 140)) + phrase * 8

    loop = find_tail_loop(tokens)

    assert loop is not None
    assert loop.repeated_fraction == 1.0
    assert loop.period == 5


def test_two_alternating_lines_are_a_loop_without_an_exact_period():
    # "A place of endless mystery, / mystery, / wonder, / mystery, / wonder": SmolLM2 at greedy, no penalty
    mystery, wonder = [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 8, 6, 7]
    tokens = list(range(100, 140)) + mystery * 2 + wonder + mystery + wonder + mystery

    loop = find_tail_loop(tokens)

    assert loop is not None and loop.repeated_fraction > 0.8
    assert loop.period == 14  # the last 2.5 cycles are exact


def test_ordinary_text_and_counting_up_are_not_loops():
    rng = np.random.default_rng(0)
    prose = rng.integers(0, 5000, 200)
    counting = [t for i in range(40) for t in (7, 100 + i, 8)]  # "1. 2. 3.": a new number in every 4-gram

    assert find_tail_loop(prose) is None
    assert find_tail_loop(counting) is None


def test_a_repeat_in_the_middle_is_not_a_tail_loop():
    tokens = [1, 2, 3] * 20 + list(range(20, 60))

    assert find_tail_loop(tokens) is None


def test_sequences_shorter_than_the_window_are_not_loops():
    assert find_tail_loop([4] * 30) is None
    assert find_tail_loop([4] * 30, window=16) is not None


def test_tail_period_needs_enough_cycles_and_tokens():
    assert tail_period([9, 8] + [1, 2, 3, 4] * 6 + [1, 2]) == 4  # cut off mid-cycle
    assert tail_period([5, 6] * 20) == 2  # the shortest period, not a multiple
    assert tail_period(list(range(40)) + [1, 2, 3, 4, 5, 6, 7] * 2) is None  # 2 cycles of 7: 14 tokens, too short
    assert tail_period(list(range(30)) + [0, 0]) is None  # a closing "\n\n" is no loop


def test_loops_are_found_in_words_too():
    words = ("once upon a time there was a cat " + "and the cat sat " * 10).split()

    loop = find_tail_loop(words, window=16)

    assert loop is not None and loop.period == 4


def test_distinct_n_is_one_without_repeats_and_falls_in_a_loop():
    assert distinct_n(list(range(50)), 2) == 1.0
    assert distinct_n([1, 2, 3] * 20, 2) == pytest.approx(3 / 59)
    assert np.isnan(distinct_n([1], 2))


def test_repeated_ngram_fraction_counts_ngrams_seen_before():
    assert repeated_ngram_fraction([1, 2, 1, 2, 3], 2) == pytest.approx(1 / 4)
    assert repeated_ngram_fraction(list(range(10)), 1) == 0.0
    with pytest.raises(ValueError, match="n >= 1"):
        repeated_ngram_fraction([1, 2], 0)


def test_median_interval_covers_the_median_and_narrows_with_more_samples():
    rng = np.random.default_rng(1)
    small = median_interval(rng.normal(10, 1, 10), "s")
    large = median_interval(rng.normal(10, 1, 1000), "s")

    assert small.low <= small.value <= small.high
    assert large.low < 10 < large.high
    assert large.high - large.low < small.high - small.low
    assert large.unit == "s" and large.n == 1000


def test_ratio_of_medians_finds_a_threefold_slowdown():
    rng = np.random.default_rng(2)
    slow, fast = rng.normal(3.0, 0.1, 40), rng.normal(1.0, 0.05, 40)

    ratio = ratio_of_medians(slow, fast)

    assert ratio.value == pytest.approx(np.median(slow) / np.median(fast))
    assert 2.7 < ratio.low < ratio.value < ratio.high < 3.3


def test_rate_interval_is_the_wilson_interval():
    # Wilson 95% for 7 of 16 (reference values from the closed form)
    rate = rate_interval(7, 16)
    assert rate.value == pytest.approx(0.4375)
    assert rate.low == pytest.approx(0.2307, abs=1e-3)
    assert rate.high == pytest.approx(0.6680, abs=1e-3)

    none = rate_interval(0, 10)
    assert none.low == 0.0 and 0.25 < none.high < 0.35
    with pytest.raises(ValueError, match="at least one trial"):
        rate_interval(0, 0)


def test_describe_ignores_missing_samples_and_refuses_none_at_all():
    summary = describe([1.0, 2.0, 3.0, 4.0, float("nan")], "s")

    assert summary["median"] == 2.5
    assert summary["iqr"] == pytest.approx(1.5)
    assert summary["n"] == 4
    assert summary["median_ci95"][0] <= 2.5 <= summary["median_ci95"][1]
    with pytest.raises(ValueError, match="no finite samples"):
        describe([float("nan")])


def test_a_rate_of_none_or_all_lies_inside_its_own_interval():
    # the Wilson bound equals the rate there in exact arithmetic; floating point once put it just past
    for trials in range(1, 60):
        for successes in (0, trials):
            rate = rate_interval(successes, trials)
            assert rate.low <= rate.value <= rate.high, (successes, trials)
