"""Reward service: the task's verifiers in killable worker processes, with a per-call timeout."""

from inflight.rewards.pool import KillablePool
from inflight.rewards.service import RewardService, ScoreItem, import_object

__all__ = ["KillablePool", "RewardService", "ScoreItem", "import_object"]
