"""REINFORCE++ (Hu et al. 2025, "REINFORCE++: Stabilizing Critic-Free Policy Optimization with Global
Normalization", arXiv 2501.03262): per-token advantages, normalised across the whole optimizer step.

    reward      r_i (reinforce_pp) or r_i − mean of its group (reinforce_pp_baseline: the group baseline first)
    KL          KL_t = log μ_t − log ref_t (k1, eq. 9: the sampling policy against the frozen reference), or
                (log μ_t − log ref_t)² / 2 (k2); no gradient: it is part of the reward
    return      G_{i,t} = r_i − β Σ_{s ≥ t} KL_s over the sample's trained tokens, β = kl_reward_coef (eq. 8, γ = 1)
    advantage   A_{i,t} = (G_{i,t} − mean G) / (std G + std_eps), mean and population std over every trained token
                of the step (eq. 10), so a long answer weighs as many tokens as it has, as in OpenRLHF

The trainer loops call this once the step's samples are all in (trainer/loop/step_advantages.py): the statistics
need the whole step, the KL needs the reference model's logprobs of every trained token. Plain Python float64 (fsum).
With FSDP2 each rank passes its own share and `total`, which sums a list of floats over the ranks: the step's
statistics are then those of every rank's tokens (the single trainer leaves `total` out: it holds the whole step).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from inflight.config.algo import AlgoConfig

STEP_ADVANTAGES = ("reinforce_pp", "reinforce_pp_baseline")
KL_ESTIMATORS = ("k1", "k2")

Total = Callable[[list[float]], list[float]]  # element-wise sum of a list over the ranks


def one_rank(values: list[float]) -> list[float]:
    return list(values)


def step_moments(rows: Sequence[Sequence[float]], trained: Sequence[Sequence[bool]], total: Total = one_rank
                 ) -> tuple[float, float, float]:
    """(n, mean, Σ(x − mean)²) over the trained entries of all rows, summed over the ranks by `total` (a collective:
    every rank calls it). Two passes, the mean first: the same formula on one rank or N, and no cancellation of
    Σx²/n − mean² when the values are far from 0. (0, 0, 0) when nothing trains."""
    flat = [x for row, m in zip(rows, trained, strict=True) for x, on in zip(row, m, strict=True) if on]
    n, s = total([float(len(flat)), math.fsum(flat)])
    if not n:
        return 0.0, 0.0, 0.0
    mean = s / n
    (sq,) = total([math.fsum((x - mean) ** 2 for x in flat)])
    return n, mean, sq


def base_rewards(rewards: Sequence[Sequence[float]], cfg: AlgoConfig) -> list[list[float]]:
    """Each sample's scalar reward before the KL and the step normalisation, per group."""
    out = []
    for gi, group in enumerate(rewards):
        r = [float(x) for x in group]
        if not all(math.isfinite(x) for x in r):
            raise ValueError(f"group {gi} has a non-finite reward: {r}")
        mean = math.fsum(r) / len(r) if cfg.advantage == "reinforce_pp_baseline" and r else 0.0
        out.append([x - mean for x in r])
    return out


def kl_estimate(mu: float, ref: float, estimator: str) -> float:
    d = mu - ref
    return d if estimator == "k1" else 0.5 * d * d


def mean_kl(mu: Sequence[Sequence[float]], ref: Sequence[Sequence[float]], trained: Sequence[Sequence[bool]],
            estimator: str, total: Total = one_rank) -> float:
    """The mean KL estimate per trained token of the step (a metric)."""
    kl = [kl_estimate(m, r, estimator) for mr, rr, tr in zip(mu, ref, trained, strict=True)
          for m, r, on in zip(mr, rr, tr, strict=True) if on]
    n, s = total([float(len(kl)), math.fsum(kl)])
    return s / n if n else 0.0


def returns(reward: float, mu: Sequence[float], ref: Sequence[float] | None, trained: Sequence[bool],
            cfg: AlgoConfig) -> list[float]:
    """G_t = r − β Σ_{s ≥ t, s trained} KL_s for every completion token (an untrained token gets the sum after it)."""
    out = [0.0] * len(trained)
    tail: list[float] = []  # the KL terms from t to the end, summed with fsum for an order-free result
    for t in range(len(trained) - 1, -1, -1):
        if trained[t] and cfg.kl_reward_coef > 0:
            assert ref is not None  # step_advantages checks
            tail.append(kl_estimate(mu[t], ref[t], cfg.kl_reward_estimator))
        out[t] = reward - cfg.kl_reward_coef * math.fsum(tail)
    return out


def step_advantages(rewards: Sequence[float], mu: Sequence[Sequence[float]], ref: Sequence[Sequence[float]] | None,
                    trained: Sequence[Sequence[bool]], cfg: AlgoConfig, total: Total = one_rank) -> list[list[float]]:
    """Per-token advantages of every sample of the step (one list per sample, one value per completion token); with
    `total`, of this rank's share, normalised by the statistics of every rank's (a collective: every rank calls it,
    with or without samples)."""
    if cfg.kl_reward_coef > 0 and ref is None:
        raise ValueError(f"algo.kl_reward_coef={cfg.kl_reward_coef} needs the reference model's logprobs")
    g = [returns(r, mu[i], None if ref is None else ref[i], trained[i], cfg) for i, r in enumerate(rewards)]
    n, mean, sq = step_moments(g, trained, total)
    if not n:
        return [[0.0] * len(row) for row in g]
    std = math.sqrt(sq / n)
    return [[(x - mean) / (std + cfg.std_eps) for x in row] for row in g]


def check(cfg: AlgoConfig) -> None:
    if cfg.kl_reward_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown algo.kl_reward_estimator {cfg.kl_reward_estimator!r}; choose k1 or k2")
    if cfg.kl_reward_coef > 0 and cfg.advantage not in STEP_ADVANTAGES:
        raise ValueError(f"algo.kl_reward_coef puts the KL in the return of reinforce_pp / reinforce_pp_baseline; "
                         f"with algo.advantage={cfg.advantage!r} use algo.kl_coef (KL in the loss)")
    if cfg.advantage in STEP_ADVANTAGES and cfg.normalize_std:
        raise ValueError(f"algo.normalize_std divides by a group's std; algo.advantage={cfg.advantage} normalises "
                         f"over the whole step instead: leave normalize_std off")
    if cfg.advantage in STEP_ADVANTAGES and not cfg.std_eps > 0:
        raise ValueError(f"algo.std_eps must be > 0, got {cfg.std_eps}")
