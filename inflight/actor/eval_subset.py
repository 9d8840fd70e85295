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
