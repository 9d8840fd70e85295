"""Advantages and RL losses: `compute_advantages(rewards, cfg)`, `make_loss(cfg) -> LossFn`, `lag_stats`."""

from inflight.algo.advantages import compute_advantages
from inflight.algo.config import AlgoConfig
from inflight.algo.losses import LOSSES, NORMALIZATIONS, lag_stats, make_loss, merge_stats

__all__ = ["AlgoConfig", "LOSSES", "NORMALIZATIONS", "compute_advantages", "lag_stats", "make_loss", "merge_stats"]
