"""Sequence-level pieces of the policy losses: GSPO's ratio and masked importance sampling.

    gspo        ℓ_i = −min(s_i·A_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i)           (Zheng et al. 2025, eq. 5-7)
                s_i = exp(mean_{t∈i} (log π_t − log μ_t)) = (π(y_i)/μ(y_i))^(1/|y_i|), |y_i| = the sample's trained
                tokens, A_i = the mean of its tokens' advantages (all equal unless REINFORCE++ puts KL in them).
                Each trained token of sample i carries ℓ_i, so `sequence_length` normalisation (the paper's) gives
                Σ_i ℓ_i / N_seq; the gradient reaches every token through s_i.
    gspo_token  ℓ_t = −min(s_t·A_t, clip(s_t, 1−ε_low, 1+ε_high)·A_t),  s_t = sg(s_i) · π_t / sg(π_t)   (eq. 13-14)
                s_t has s_i's value and log π_t's gradient: with equal advantages in a sample, the gradient of
                GSPO (eq. 11) and GSPO-token (eq. 18) are the same.

Masked importance sampling (`is_mask`, the generator/trainer mismatch: TRL #4493, #4772; verl's rollout rejection
sampling `rollout_rs`): a sample whose ratio ρ_i is outside [is_mask_low, is_mask_high] leaves the policy term whole
(its tokens are dropped like decoupled_ppo's, the denominators count the step as before). ρ_i is computed without
gradient from the trainer's logprobs before this optimizer step (the forward of this backward) and μ:
    sequence   ρ_i = Π_t π_t/μ_t          (verl `rollout_rs: sequence`, the "seq-mask-tis" MIS of the mismatch blog)
    geometric  ρ_i = (Π_t π_t/μ_t)^(1/|y_i|)   (verl `rollout_rs: geometric`; length-independent, tighter bounds)
"""

from __future__ import annotations

import math

import torch

from inflight.config.algo import AlgoConfig

IS_MASKS = ("none", "sequence", "geometric")


class Samples:
    """Per-sample sums and means over a micro-batch's trained tokens, spread back over the tokens."""

    def __init__(self, sample_index: torch.Tensor, num_samples: int, mask: torch.Tensor):
        self.index, self.n, self.mask = sample_index, num_samples, mask  # mask: float [T], 1 on trained tokens

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """[n]: Σ over each sample's trained tokens (keeps the gradient)."""
        return x.new_zeros(self.n).index_add(0, self.index, x * self.mask)

    def count(self) -> torch.Tensor:
        return self.mask.new_zeros(self.n).index_add(0, self.index, self.mask)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """[T]: each token gets the mean over its sample's trained tokens (0 for a sample without any)."""
        return (self.sum(x) / self.count().clamp(min=1))[self.index]


def gspo_ratio(logp: torch.Tensor, mu: torch.Tensor, seq: Samples) -> torch.Tensor:
    """s_i on every token of sample i, with gradient; the mean log ratio is clamped so exp cannot overflow."""
    return torch.exp(seq.mean(logp - mu).clamp(-80.0, 80.0))


def masked_out(log_ratio: torch.Tensor, seq: Samples, cfg: AlgoConfig) -> torch.Tensor:
    """bool [T]: the tokens of samples whose sequence ratio (cfg.is_mask) is outside [is_mask_low, is_mask_high]."""
    if cfg.is_mask == "none":
        return torch.zeros_like(log_ratio, dtype=torch.bool)
    log_rho = seq.sum(log_ratio) if cfg.is_mask == "sequence" else seq.sum(log_ratio) / seq.count().clamp(min=1)
    lo = math.log(cfg.is_mask_low) if cfg.is_mask_low > 0 else -math.inf
    out = (log_rho < lo) | (log_rho > math.log(cfg.is_mask_high))
    return out[seq.index]


def check(cfg: AlgoConfig) -> None:
    if cfg.is_mask not in IS_MASKS:
        raise ValueError(f"unknown algo.is_mask {cfg.is_mask!r}; choose one of {list(IS_MASKS)}")
    if cfg.is_mask != "none" and not 0 <= cfg.is_mask_low < 1 < cfg.is_mask_high:
        raise ValueError(f"algo.is_mask_low / is_mask_high must satisfy 0 <= low < 1 < high, got "
                         f"{cfg.is_mask_low} / {cfg.is_mask_high}")
