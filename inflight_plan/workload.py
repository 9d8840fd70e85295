"""What the simulator runs: the loop's settings (from a RunConfig or given directly) and the completion lengths.

Lengths are an empirical list (sampled with replacement; e.g. the lengths of a real run) or a parametric
distribution: `fixed:N`, `uniform:A:B`, `lognormal:MEDIAN:SIGMA:MAX` (cut at MAX, the `max_new_tokens` limit).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from inflight.config import RunConfig
from inflight.config.limits import Staleness, effective_max_lag


@dataclass
class Lengths:
    spec: str = "fixed:16"
    values: list[int] = field(default_factory=list)  # empirical: sampled with replacement (spec is then ignored)

    def __post_init__(self) -> None:
        if self.values:
            if min(self.values) < 1:
                raise ValueError("completion lengths must be >= 1")
            return
        kind, *args = self.spec.split(":")
        try:
            nums = [float(a) for a in args]
        except ValueError:
            raise ValueError(f"bad length spec {self.spec!r}") from None
        want = {"fixed": 1, "uniform": 2, "lognormal": 3}
        if kind not in want or len(nums) != want[kind] or min(nums) <= 0:
            raise ValueError(f"bad length spec {self.spec!r}: fixed:N | uniform:A:B | lognormal:MEDIAN:SIGMA:MAX")
        self._kind, self._nums = kind, nums

    def sample(self, rng: random.Random) -> int:
        if self.values:
            return rng.choice(self.values)
        n = self._nums
        if self._kind == "fixed":
            return int(n[0])
        if self._kind == "uniform":
            return rng.randint(int(n[0]), int(n[1]))
        return max(1, min(int(n[2]), round(rng.lognormvariate(math.log(n[0]), n[1]))))

    def mean(self, rng_seed: int = 0, n: int = 20000) -> float:
        if self.values:
            return sum(self.values) / len(self.values)
        rng = random.Random(rng_seed)
        return sum(self.sample(rng) for _ in range(n)) / n


@dataclass
class SimConfig:
    mode: str = "pipelined"  # pipelined | sync
    update_mode: str = "keep"  # keep | interrupt (in-flight sequences re-prefilled after an update)
    num_grad_steps: int = 4  # sync: optimizer steps per generation round
    servers: int = 1
    max_batch: int = 128
    group_size: int = 8
    groups_per_step: int = 16
    max_lag: int = 1  # as the user sets it: sync mode applies num_grad_steps - 1 (`staleness`)
    gated: bool = True  # servers hold a request until they have min_weight_version (the built-in engine)
    queue_ahead: int = 1  # gated: steps of groups sent beyond the bound
    concurrency_per_server: int = 64  # outstanding requests (groups) per server
    prompt_tokens: int = 8
    lengths: Lengths = field(default_factory=Lengths)
    trainer_devices: int = 1
    # share of the forward tokens (each group's prompt once, every completion) back-propagated: the trainer skips
    # zero-advantage groups (runs.trained_share measures it)
    trained_frac: float = 1.0
    share_prompt: bool = False  # the engine prefills a group's prompt once (else once per sequence)
    steps: int = 20  # optimizer steps to simulate
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("pipelined", "sync") or self.update_mode not in ("keep", "interrupt"):
            raise ValueError("mode must be pipelined | sync and update_mode keep | interrupt")
        ints = (self.servers, self.max_batch, self.group_size, self.groups_per_step, self.num_grad_steps, self.steps,
                self.concurrency_per_server, self.trainer_devices)
        if min(ints) < 1 or self.max_lag < 0 or self.queue_ahead < 0 or self.prompt_tokens < 0:
            raise ValueError("servers, batch, group and step sizes must be >= 1; max_lag, queue_ahead >= 0")
        if not 0.0 <= self.trained_frac <= 1.0:
            raise ValueError("trained_frac must be in [0, 1]")
        if self.mode == "sync":  # whole rounds (the bound is num_grad_steps - 1: `staleness`)
            if self.steps % self.num_grad_steps:
                self.steps += self.num_grad_steps - self.steps % self.num_grad_steps

    @property
    def staleness(self) -> Staleness:
        """The bound a run with these settings applies: the same as the actor's, trainer's and launcher's."""
        return Staleness(max_lag=effective_max_lag(self.max_lag, self.mode, self.num_grad_steps),
                         groups_per_step=self.groups_per_step, gated=self.gated, queue_ahead=self.queue_ahead)


def from_run_config(cfg: RunConfig, lengths: Lengths, **over: Any) -> SimConfig:
    """A SimConfig with the settings of a RunConfig (inflight/config/); `over` sets the rest (steps, servers...)."""
    a, p, s = cfg.actor, cfg.pipeline, cfg.server
    kw: dict[str, Any] = dict(
        mode=p.mode, update_mode=p.update_mode, num_grad_steps=p.num_grad_steps, servers=s.num_servers,
        max_batch=s.max_batch, group_size=a.group_size, groups_per_step=a.groups_per_step, max_lag=a.max_lag,
        gated=a.gated, queue_ahead=0 if a.dynamic_sampling else a.queue_ahead,  # config/limits.py
        concurrency_per_server=a.concurrency_per_server,
        lengths=lengths, trainer_devices=max(1, cfg.trainer.num_processes), seed=cfg.seed)
    kw.update(over)
    return SimConfig(**kw)
