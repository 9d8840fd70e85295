"""Group-relative advantages: one scalar per sample, from the rewards of the G samples of its prompt.

    group_mean     A_i = r_i − mean(r)                        (GRPO / PipelineRL baseline)
    leave_one_out  A_i = r_i − Σ_{j≠i} r_j / (G − 1)          (RLOO; = G/(G−1) · (r_i − mean(r)))
    normalize_std  A_i ← A_i / (std(r) + eps)                 std over the group, population form (divide by G)

A group whose rewards are all equal carries no signal and gets exactly 0 for every sample (also G = 1).
REINFORCE++'s advantages (per token, normalised across the step) are in reinforce_pp.py.
Arithmetic is plain Python float64 (math.fsum), so results do not depend on the order of the group.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from inflight.algo.reinforce_pp import STEP_ADVANTAGES
from inflight.config.algo import AlgoConfig

# advantages the trainer loop computes once a step's samples are all in: REINFORCE++'s, and GAE's (gae.py), which
# needs the critic's values
STEP_LEVEL = STEP_ADVANTAGES + ("gae",)


def group_mean(r: list[float]) -> list[float]:
    """A_i = r_i − mean(r)."""
    mean = math.fsum(r) / len(r)
    return [x - mean for x in r]


def leave_one_out(r: list[float]) -> list[float]:
    """A_i = r_i − mean of the other G − 1 rewards."""
    total = math.fsum(r)
    return [x - (total - x) / (len(r) - 1) for x in r]


BASELINES: dict[str, Callable[[list[float]], list[float]]] = {
    "group_mean": group_mean,
    "leave_one_out": leave_one_out,
}


def group_std(r: list[float]) -> float:
    """Population standard deviation sqrt(Σ (r_i − mean)² / G)."""
    mean = math.fsum(r) / len(r)
    return math.sqrt(math.fsum((x - mean) ** 2 for x in r) / len(r))


def compute_advantages(rewards: Sequence[Sequence[float]], cfg: AlgoConfig) -> list[list[float]]:
    """Advantages for a list of groups (one list of rewards per prompt), same shape as `rewards`."""
    if cfg.advantage in STEP_LEVEL:  # per token, from the whole step: reinforce_pp.py, gae.py, in the trainer loop
        raise ValueError(f"algo.advantage={cfg.advantage!r} is computed per optimizer step by the trainer loop "
                         f"(inflight.algo.reinforce_pp / inflight.algo.gae), not per group")
    if cfg.advantage not in BASELINES:
        raise ValueError(f"unknown algo.advantage {cfg.advantage!r}; choose one of {sorted(BASELINES)}")
    if cfg.normalize_std and not cfg.std_eps > 0:
        raise ValueError(f"algo.std_eps must be > 0, got {cfg.std_eps}")
    out = []
    for gi, group in enumerate(rewards):
        r = [float(x) for x in group]
        if not all(math.isfinite(x) for x in r):
            raise ValueError(f"group {gi} has a non-finite reward: {r}")
        if len(r) == 0 or all(x == r[0] for x in r):  # no signal; exact zeros, no rounding residue
            out.append([0.0] * len(r))
            continue
        adv = BASELINES[cfg.advantage](r)
        if cfg.normalize_std:
            s = group_std(r) + cfg.std_eps
            adv = [a / s for a in adv]
        out.append(adv)
    return out
