"""The rotating evaluation subset covers the whole held-out split, and the accuracy's standard error is the
binomial one, against plain references; whole-split scores from runs of subsets."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from inflight.actor.eval_subset import binomial_stderr, rotating_subset, whole_split_scores, whole_split_series


@pytest.mark.parametrize("n,size", [(200, 50), (100, 25), (10, 3), (7, 7), (5, 1)])
def test_rotation_covers_the_split_in_ceil_n_over_size_evaluations(n, size):
    split = [f"p{i}" for i in range(n)]
    k = math.ceil(n / size)
    for first in (0, 3):  # any k consecutive evaluations, not only the first k
        windows = [rotating_subset(split, size, first + r) for r in range(k)]
        assert all(len(w) == size and len(set(w)) == size for w in windows)
        assert set().union(*windows) == set(split)
    # k - 1 evaluations miss something whenever the windows do not overlap
    if n % size == 0 and k > 1:
        assert set().union(*(rotating_subset(split, size, r) for r in range(k - 1))) != set(split)


def test_rotation_windows_are_consecutive_and_wrap():
    split = list(range(10))
    assert rotating_subset(split, 4, 0) == [0, 1, 2, 3]
    assert rotating_subset(split, 4, 1) == [4, 5, 6, 7]
    assert rotating_subset(split, 4, 2) == [8, 9, 0, 1]  # wraps around
    assert rotating_subset(split, 4, 3) == [2, 3, 4, 5]
    assert rotating_subset(split, 0, 5) == split and rotating_subset(split, 10, 3) == split  # the whole split
    assert rotating_subset(split, 50, 1) == split


def test_rotation_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="subset size"):
        rotating_subset([1, 2], -1, 0)
    with pytest.raises(ValueError, match="round"):
        rotating_subset([1, 2], 1, -1)


@pytest.mark.parametrize("correct,n", [(0, 50), (1, 50), (17, 50), (25, 50), (50, 50), (83, 200), (7, 25)])
def test_stderr_equals_the_spread_of_the_outcomes_over_sqrt_n(correct, n):
    """Plain reference: the population standard deviation of the 0/1 outcomes, divided by sqrt(n)."""
    outcomes = [1.0] * correct + [0.0] * (n - correct)
    want = statistics.pstdev(outcomes) / math.sqrt(n)
    assert binomial_stderr(correct / n, n) == pytest.approx(want, abs=1e-12)


def test_stderr_values_and_bad_input():
    assert binomial_stderr(0.5, 100) == pytest.approx(0.05, abs=1e-15)
    assert binomial_stderr(0.2, 100) == pytest.approx(0.04, abs=1e-15)
    assert binomial_stderr(1.0, 10) == 0.0
    with pytest.raises(ValueError, match="n > 0"):
        binomial_stderr(0.5, 0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        binomial_stderr(1.5, 10)


def test_whole_split_scores_of_a_fixed_policy_equal_its_accuracy_on_the_split():
    # a policy that does not change: each problem right or wrong for good; subsets of 50 rotate over 200
    rng = random.Random(3)
    right = [rng.random() < 0.7 for _ in range(200)]
    problems = list(range(200))
    evals = [(sum(right) / 200, 200, 200)]  # base: the whole split
    for k in range(9):
        sub = rotating_subset(problems, 50, k)
        evals.append((sum(right[p] for p in sub) / 50, 50, 200))
    scores = whole_split_scores(evals)
    # the base, then one score per window of 4 consecutive subsets (subset evaluations 4..9), each the whole split
    assert len(scores) == 1 + 6
    for s in scores:
        assert s == pytest.approx(sum(right) / 200, abs=1e-12)
    assert max(acc for acc, _, _ in evals[1:]) > sum(right) / 200  # a single subset's best overstates it


def test_whole_split_scores_weigh_by_problems_and_restart_after_a_full_evaluation():
    evals = [(0.5, 40, 100), (0.6, 40, 100), (0.9, 20, 100), (0.8, 100, 100), (0.1, 60, 100), (0.3, 60, 100)]
    assert whole_split_scores(evals) == pytest.approx([
        (0.5 * 40 + 0.6 * 40 + 0.9 * 20) / 100,  # the first three cover the split
        0.8,  # a whole-split evaluation as it is
        (0.3 * 60 + 0.1 * 60) / 120,  # the last two, not across the full one
    ])
    assert whole_split_scores([(0.4, 10, 100)]) == []  # a split never covered gives no estimate


def test_whole_split_series_is_aligned_with_the_evaluations():
    """One entry per evaluation: None until a rotation completes; whole_split_scores is the series without them."""
    evals = [(0.5, 40, 100), (0.6, 40, 100), (0.9, 20, 100), (0.8, 100, 100), (0.1, 60, 100), (0.3, 60, 100)]
    series = whole_split_series(evals)
    assert series[0] is None and series[1] is None and series[4] is None
    assert series[2] == pytest.approx((0.5 * 40 + 0.6 * 40 + 0.9 * 20) / 100)
    assert series[3] == 0.8 and series[5] == pytest.approx(0.2)
    assert [s for s in series if s is not None] == whole_split_scores(evals)
