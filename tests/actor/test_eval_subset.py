"""The rotating evaluation subset covers the whole held-out split, and the accuracy's standard error is the
binomial one, against plain references."""

from __future__ import annotations

import math
import statistics

import pytest

from inflight.actor.eval_subset import binomial_stderr, rotating_subset


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
