"""Which held-out problems an in-run evaluation scores, and how sure its accuracy is.

A rotating subset keeps each evaluation cheap and still covers the whole held-out split: evaluation k scores the
`size` problems from position k * size on (wrapping around), so any ceil(n / size) consecutive evaluations score
every problem at least once. The first (base) and final evaluations score the whole split.
"""

from __future__ import annotations

import math
from typing import Sequence, TypeVar

T = TypeVar("T")


def rotating_subset(problems: Sequence[T], size: int, round_index: int) -> list[T]:
    """Evaluation `round_index`'s problems: `size` of them from position round_index * size, wrapping around;
    all of them (in order) when size is 0 or covers the split."""
    n = len(problems)
    if size < 0:
        raise ValueError(f"eval subset size must be >= 0, got {size}")
    if round_index < 0:
        raise ValueError(f"evaluation round must be >= 0, got {round_index}")
    if size == 0 or size >= n:
        return list(problems)
    start = (round_index * size) % n
    return [problems[(start + i) % n] for i in range(size)]


def binomial_stderr(p: float, n: int) -> float:
    """Standard error of an accuracy p measured on n independent problems: sqrt(p (1 - p) / n)."""
    if n <= 0:
        raise ValueError(f"stderr needs n > 0 problems, got {n}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"accuracy must lie in [0, 1], got {p}")
    return math.sqrt(p * (1.0 - p) / n)


def whole_split_series(evals: Sequence[tuple[float, int, int]]) -> list[float | None]:
    """For each evaluation (in run order, each given as (accuracy, problems scored, split size)), the accuracy on the
    whole held-out split as known right after it, or None while the split is not covered yet: an evaluation of the
    whole split counts as it is; a rotating-subset one, with the evaluations just before it that together score the
    split (the last full rotation of windows), counts as their problem-weighted mean. A whole-split evaluation breaks
    a run of subsets. This is the curve a report draws: a converged model's single windows swing by their own noise
    (±6.5 points for 50 problems at 70%), the rotation's mean rests on every problem once."""
    scores: list[float | None] = []
    for i, (acc, n, split) in enumerate(evals):
        if n >= split:
            scores.append(acc)
            continue
        score: float | None = None
        right, scored = 0.0, 0
        for prev_acc, prev_n, _ in reversed(evals[: i + 1]):
            if prev_n >= split:  # a whole-split evaluation breaks the run of subsets
                break
            right, scored = right + prev_acc * prev_n, scored + prev_n
            if scored >= split:
                score = right / scored
                break
        scores.append(score)
    return scores


def whole_split_scores(evals: Sequence[tuple[float, int, int]]) -> list[float]:
    """Accuracy estimates that each rest on the whole held-out split, from evaluations in run order, each given as
    (accuracy, problems scored, split size): an evaluation of the whole split counts as it is, and every run of
    consecutive rotating-subset evaluations that together score the split counts as their problem-weighted mean
    (whole_split_series without the evaluations that have no estimate yet).

    The best of these is a run's best accuracy: the best single subset would pick the luckiest draw of a noisy
    measurement (with 50 of 200 problems, ±6.5 points each, the best of 60 sits ~2 standard errors above the truth)."""
    return [s for s in whole_split_series(evals) if s is not None]
