"""REINFORCE++'s per-token advantages of one optimizer step (algo/reinforce_pp.py), for the single trainer and for
each FSDP2 rank.

The caller passes the step's trained samples it holds (the single trainer: all of them; an FSDP2 rank: its share)
with their base rewards. The reference model's logprobs are forwards over micro-batches of those samples; with
FSDP2 they are collectives, so every rank runs as many as the rank with the most, a rank short of work running
stand-ins (accumulate.empty_batch). The step's statistics (mean and std of the returns, mean KL) are then sums over
every rank's tokens, in float64 on the gloo cpu_group: every rank gets the advantages the single trainer would give
its samples.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from inflight.algo import reinforce_pp
from inflight.config import RunConfig
from inflight.contracts import Sample
from inflight.trainer.accumulate import empty_batch
from inflight.trainer.packing import collate, completion_mask, completion_slices, first_fit_decreasing


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
