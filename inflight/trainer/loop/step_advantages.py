"""One optimizer step's samples (`StepData`), and the advantages that need all of them before the policy's backward.

- REINFORCE++ (`algo.advantage: reinforce_pp | reinforce_pp_baseline`, algo/reinforce_pp.py), for the single
  trainer and for each FSDP2 rank (`per_token_advantages`). The caller passes the step's trained samples it holds
  (the single trainer: all of them; an FSDP2 rank: its share) with their base rewards. The reference model's
  logprobs are forwards over micro-batches of those samples; with FSDP2 they are collectives, so every rank runs as
  many as the rank with the most, a rank short of work running stand-ins (accumulate.empty_batch). The step's
  statistics (mean and std of the returns, mean KL) are then sums over every rank's tokens, in float64 on the gloo
  cpu_group: every rank gets the advantages the single trainer would give its samples.
- GAE (`algo.advantage: gae`, algo/gae.py): the critic's current values of every trained sample the caller holds,
  then GAE per sample and the whitening over the step (`gae_advantages`; the single trainer through `gae_step`); the
  critic trains on the returns once the policy's backward has used the advantages (`CriticWork.train`). With FSDP2
  the critic is sharded like the policy (trainer/critic_fsdp.py): its forwards and backwards are collectives (every
  rank runs as many, with stand-ins), the whitening statistics and the value loss's token counts are sums over the
  ranks, so each rank's share gets what the single trainer would give it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from inflight.algo import gae, reinforce_pp
from inflight.config import RunConfig
from inflight.contracts import Sample
from inflight.trainer.accumulate import empty_batch
from inflight.trainer.packing import collate, completion_mask, completion_slices, first_fit_decreasing


@dataclass
class StepData:
    """The samples of one optimizer step seen so far, with their advantages, and the micro-batches not yet run."""

    samples: list[Sample] = field(default_factory=list)
    advantages: list[float | list[float]] = field(default_factory=list)  # per sample, or per completion token
    pending: list[int] = field(default_factory=list)  # indices into samples not yet back-propagated
    skipped: list[int] = field(default_factory=list)  # zero-advantage samples left out of the backward
    masked: list[int] = field(default_factory=list)  # truncated samples left out of the loss (algo.truncated=mask)
    trained: int = 0  # samples back-propagated
    forward_tokens: int = 0  # tokens the forward/backward ran over (a shared prompt once per micro-batch)
    groups: int = 0
    rewards: list[float] = field(default_factory=list)
    kl_reward: float = 0.0  # REINFORCE++: mean KL(mu / ref) per trained token, the estimate in the return


def trained_tokens(s: Sample) -> list[bool]:
    """Which completion tokens train (the loss mask's completion part)."""
    mask = [m > 0 for m in completion_mask(s)]
    if not s.prompt_ids and mask:  # nothing predicts a sample's first token
        mask[0] = False
    return mask


def _max_over_ranks(n: int, world: int, group: Any) -> int:
    if world <= 1:
        return n
    t = torch.tensor([n], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def sum_over_ranks(world: int, group: Any) -> reinforce_pp.Total:
    """reinforce_pp's `total`: a list of floats summed element-wise over the ranks (float64, CPU: the gloo group)."""
    def total(values: list[float]) -> list[float]:
        if world <= 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t.tolist()
    return total


def reference_logprobs(ref: Any, samples: list[Sample], budget: int, temperature: float, world: int = 1,
                       group: Any = None) -> list[list[float]]:
    """The reference model's logprob of every completion token of each sample (collective with world > 1: every
    rank calls it, with or without samples)."""
    bins = first_fit_decreasing([len(s) for s in samples], budget) if samples else []
    by_sample: dict[int, list[float]] = {}
    for k in range(_max_over_ranks(len(bins), world, group)):
        if k >= len(bins):
            ref.forward_logprobs(empty_batch(1, 1))  # this rank's share is done; the others' forwards need it
            continue
        part = [samples[j] for j in bins[k]]
        logp = ref.forward_logprobs(collate(part, [0.0] * len(part), 1, 1, temperature=temperature)).double().tolist()
        for j, (lo, hi) in zip(bins[k], completion_slices(part), strict=True):
            by_sample[j] = logp[lo:hi]
    return [by_sample[j] for j in range(len(samples))]


def per_token_advantages(samples: list[Sample], rewards: list[float], cfg: RunConfig, ref_policy: Any = None,
                         world: int = 1, group: Any = None) -> tuple[list[list[float]], float]:
    """The per-token advantages of `samples` (base rewards `rewards`: reinforce_pp.base_rewards) and the step's mean
    KL per trained token (0.0 without algo.kl_reward_coef). Collective with world > 1."""
    beta = cfg.algo.kl_reward_coef
    mu = [list(s.logprobs) for s in samples]
    trained = [trained_tokens(s) for s in samples]
    total = sum_over_ranks(world, group)
    ref, kl = None, 0.0
    if beta > 0:
        if ref_policy is None:
            raise ValueError("algo.kl_reward_coef > 0 needs the reference model (built by the trainer role)")
        ref = reference_logprobs(ref_policy, samples, cfg.trainer.micro_batch_tokens, cfg.actor.temperature, world,
                                 group)
        kl = reinforce_pp.mean_kl(mu, ref, trained, cfg.algo.kl_reward_estimator, total)
    return reinforce_pp.step_advantages(rewards, mu, ref, trained, cfg.algo, total), kl


@dataclass
class CriticWork:
    """The step's trained samples (an FSDP2 rank: its share) with the critic's values (before its update) and their
    GAE returns. `index`: each sample's position among the whole step's trained samples and `n_step` their number
    (the critic's mini-batches are slices of the whole step); `total`: sums over the ranks."""

    samples: list[Sample]
    values: list[list[float]]
    returns: list[list[float]]
    trained: list[list[bool]]
    index: list[int] | None = None  # None: the single trainer, positions 0..n-1
    n_step: int | None = None
    total: reinforce_pp.Total = field(default=reinforce_pp.one_rank)

    def stats(self) -> dict[str, float]:
        flat = [v for row, m in zip(self.values, self.trained, strict=True) for v, on in zip(row, m, strict=True) if on]
        ret = [r for row, m in zip(self.returns, self.trained, strict=True) for r, on in zip(row, m, strict=True)
               if on]
        n, sum_v, sum_r = self.total([float(len(flat)), math.fsum(flat), math.fsum(ret)])
        return {"explained_variance": gae.explained_variance(self.values, self.returns, self.trained, self.total),
                "value_mean": sum_v / max(1.0, n), "returns_mean": sum_r / max(1.0, n)}

    def train(self, critic: Any) -> dict[str, float]:
        """The critic's update on this step's returns; its stats with the values' (explained variance: of the values
        the advantages used). Collective with FSDP2."""
        n_step = len(self.samples) if self.n_step is None else self.n_step
        if not n_step:
            return {**self.stats(), "value_loss": 0.0, "value_clip_frac": 0.0}
        return {**self.stats(), **critic.train(self.samples, self.values, self.returns, self.index, n_step)}


def gae_advantages(samples: list[Sample], rewards: list[float], cfg: RunConfig, critic: Any, world: int = 1,
                   group: Any = None) -> tuple[list[list[float]], CriticWork]:
    """GAE: the per-token advantages of `samples` (rewards `rewards`) from the critic's current values, whitened over
    the step (with world > 1: over every rank's tokens, a collective), and what the critic then trains on."""
    trained = [trained_tokens(s) for s in samples]
    values = critic.values(samples)
    total = sum_over_ranks(world, group)
    adv, returns = gae.step_advantages(rewards, values, trained, cfg.algo, total)
    return adv, CriticWork(samples, values, returns, trained, total=total)


def gae_step(data: StepData, cfg: RunConfig, critic: Any) -> CriticWork:
    """The single trainer's GAE step: the per-token advantages of the step's trained samples (their rewards in
    data.advantages until now); returns what the critic then trains on."""
    idx = list(data.pending)
    rewards = [float(data.advantages[i]) for i in idx]  # type: ignore[arg-type]  # scalars until here
    adv, work = gae_advantages([data.samples[i] for i in idx], rewards, cfg, critic)
    for i, a in zip(idx, adv, strict=True):
        data.advantages[i] = a
    return work
