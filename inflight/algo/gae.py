"""PPO with a critic: Generalized Advantage Estimation over a completion's tokens, and PPO's clipped value loss.

    rewards     r_t = the sample's reward on its last trained token, 0 on the others (no KL in the reward)
    TD error    δ_t = r_t + γ V(s_{t+1}) − V(s_t),  V after the last trained token = 0 (the episode ends)
    advantage   A_t = Σ_{l ≥ 0} (γλ)^l δ_{t+l}            (Schulman et al. 2016, "High-Dimensional Continuous Control
                                                         Using Generalized Advantage Estimation", eq. 16)
    return      R_t = A_t + V(s_t)                        (the value target, before whitening)
    whitening   A_t ← (A_t − mean A) / sqrt(var A + 1e-8)  over every trained token of the step, var unbiased
                                                         (verl's masked_whiten, which its GAE applies by default)
    value loss  ½ · max((V − R)², (V_old + clip(V − V_old, −ε_v, ε_v) − R)²)  per token (OpenAI baselines' ppo2,
                verl's compute_value_loss), averaged over the trained tokens of a critic mini-batch

V(s_t), the value of completion token t's state, is read from the critic's hidden state at the token before t (the
one that predicts t), as the policy's logprob of t is. Tokens that are not trained (an environment's tokens in an
episode, a sample's first token without a prompt) are skipped: the next state of a trained token is the next trained
one. The step's advantages need the critic's values of every sample first, so the trainer loop computes them once
the step's samples are all in (trainer/loop/step_advantages.py). Plain Python float64 here, torch for the loss.
With FSDP2 each rank passes its own share and `total` (reinforce_pp.Total: a list of floats summed over the ranks), so
the whitening uses the statistics of every rank's tokens; the single trainer leaves `total` out.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from inflight.algo.reinforce_pp import Total, one_rank, step_moments
from inflight.config.algo import AlgoConfig
from inflight.config.critic import CriticConfig

ADVANTAGE = "gae"
WHITEN_EPS = 1e-8  # verl's masked_whiten


def sample_gae(reward: float, values: Sequence[float], trained: Sequence[bool], gamma: float, lam: float
               ) -> tuple[list[float], list[float]]:
    """(A_t, R_t) for every completion token of one sample (0 on tokens not trained)."""
    adv, ret = [0.0] * len(trained), [0.0] * len(trained)
    steps = [t for t, on in enumerate(trained) if on]
    running, next_value = 0.0, 0.0
    for k, t in enumerate(reversed(steps)):
        r = float(reward) if k == 0 else 0.0
        delta = r + gamma * next_value - float(values[t])
        running = delta + gamma * lam * running
        adv[t], ret[t] = running, running + float(values[t])
        next_value = float(values[t])
    return adv, ret


def whiten(rows: list[list[float]], trained: Sequence[Sequence[bool]], total: Total = one_rank
           ) -> list[list[float]]:
    """(x − mean) / sqrt(var + 1e-8) over the trained entries of all rows (var unbiased; 0 for one entry); the
    others stay 0. With `total`, over every rank's entries (a collective: every rank calls it)."""
    n, mean, sq = step_moments(rows, trained, total)
    if not n:
        return [[0.0] * len(row) for row in rows]
    var = sq / (n - 1) if n > 1 else 0.0
    scale = 1.0 / math.sqrt(var + WHITEN_EPS)
    return [[(x - mean) * scale if on else 0.0 for x, on in zip(row, m, strict=True)]
            for row, m in zip(rows, trained, strict=True)]


def step_advantages(rewards: Sequence[float], values: Sequence[Sequence[float]], trained: Sequence[Sequence[bool]],
                    cfg: AlgoConfig, total: Total = one_rank) -> tuple[list[list[float]], list[list[float]]]:
    """Per-token advantages (whitened over the step when cfg.gae_whiten) and returns of every sample of the step;
    with `total`, of this rank's share, whitened with the statistics of every rank's (collective)."""
    pairs = [sample_gae(r, v, m, cfg.gamma, cfg.lam) for r, v, m in zip(rewards, values, trained, strict=True)]
    adv = [a for a, _ in pairs]
    if cfg.gae_whiten:
        adv = whiten(adv, trained, total)
    return adv, [r for _, r in pairs]


def explained_variance(values: Sequence[Sequence[float]], returns: Sequence[Sequence[float]],
                       trained: Sequence[Sequence[bool]], total: Total = one_rank) -> float:
    """1 − Var(R − V) / Var(R) over the trained tokens (1: V predicts R exactly; 0: no better than R's mean, and 0
    when the returns do not vary); with `total`, over every rank's tokens (collective)."""
    pairs = [(r, v) for vr, rr, m in zip(values, returns, trained, strict=True)
             for v, r, on in zip(vr, rr, m, strict=True) if on]
    n, sum_r, sum_d = total([float(len(pairs)), math.fsum(r for r, _ in pairs), math.fsum(r - v for r, v in pairs)])
    if n < 2:
        return 0.0
    mean_r, mean_d = sum_r / n, sum_d / n
    var_r, var_d = total([math.fsum((r - mean_r) ** 2 for r, _ in pairs),
                          math.fsum((r - v - mean_d) ** 2 for r, v in pairs)])
    return 1.0 - var_d / var_r if var_r > 0 else 0.0


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token ½ · max((V − R)², (V_old + clip(V − V_old, −ε, ε) − R)²) and where the clipped term is the larger
    (gradient through the clipped V: 0 outside the band); ε = 0: ½ (V − R)², nothing clipped."""
    plain = (values - returns) ** 2
    if clip <= 0:
        return 0.5 * plain, torch.zeros_like(plain, dtype=torch.bool)
    clipped_v = old_values + (values - old_values).clamp(-clip, clip)
    other = (clipped_v - returns) ** 2
    return 0.5 * torch.maximum(plain, other), other > plain


def check(cfg: AlgoConfig, critic: CriticConfig) -> None:
    if cfg.advantage != ADVANTAGE:
        return
    if not (0.0 <= cfg.gamma <= 1.0 and 0.0 <= cfg.lam <= 1.0):
        raise ValueError(f"algo.gamma and algo.lam must be in [0, 1], got {cfg.gamma} and {cfg.lam}")
    if cfg.normalize_std:
        raise ValueError("algo.normalize_std divides by a group's std; algo.advantage=gae whitens over the step "
                         "instead (algo.gae_whiten): leave normalize_std off")
    if cfg.loss == "gspo":
        raise ValueError("algo.loss=gspo takes one advantage per sample; algo.advantage=gae gives one per token: "
                         "use algo.loss=ppo (or gspo_token)")
    if critic.lr < 0 or critic.weight_decay < 0 or critic.value_clip < 0 or critic.warmup_steps < 0:
        raise ValueError("critic.lr, critic.weight_decay, critic.value_clip and critic.warmup_steps must be >= 0")
    if critic.mini_batches < 1:
        raise ValueError(f"critic.mini_batches must be >= 1, got {critic.mini_batches}")
