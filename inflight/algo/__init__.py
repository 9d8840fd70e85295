"""Advantages and RL losses: `compute_advantages(rewards, cfg)` (per group), REINFORCE++'s per-token advantages of a
whole step (`reinforce_pp`), `make_loss(cfg) -> LossFn` (token-level losses in `losses`, GSPO's sequence ratio and
masked importance sampling in `sequence`), `lag_stats`; what training does with truncated completions (`truncation`).

The names load on first use: the actor and the reward service import `inflight.algo.truncation` without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from inflight.config.algo import AlgoConfig

_WHERE = {"compute_advantages": "advantages", "LOSSES": "losses", "NORMALIZATIONS": "losses",
          "lag_stats": "losses", "make_loss": "losses", "merge_stats": "losses"}

__all__ = ["AlgoConfig", "LOSSES", "NORMALIZATIONS", "compute_advantages", "lag_stats", "make_loss", "merge_stats"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"inflight.algo.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'inflight.algo' has no attribute {name!r}")
