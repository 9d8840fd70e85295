"""Tasks with verifiable rewards: `get_task(cfg)` returns one by `cfg.name` (arith | arith_tool | math_jsonl |
reasoning_gym | verifiers | openenv). A task with `make_env` (contracts.EnvTask, e.g. arith_tool, verifiers, openenv)
runs multi-turn episodes. Each task module imports its heavy or optional library (math-verify, reasoning-gym,
verifiers, openenv-core) only when that task is built or scores."""

from __future__ import annotations

from inflight.config.tasks import TaskConfig
from inflight.contracts import Task
from inflight.tasks.arith import ArithTask
from inflight.tasks.arith_tool import ArithToolTask
from inflight.tasks.math_jsonl import MathJsonlTask
from inflight.tasks.openenv_env import OpenEnvTask
from inflight.tasks.reasoning_gym_task import ReasoningGymTask
from inflight.tasks.verifiers_env import VerifiersTask
from inflight.tasks.verifiers_v1 import VerifiersV1Task, is_v1_installed

TASKS = ("arith", "arith_tool", "math_jsonl", "reasoning_gym", "verifiers", "openenv")


def get_task(cfg: TaskConfig) -> Task:
    """Build the task named by cfg.name."""
    if cfg.name == "arith":
        return ArithTask(cfg)
    if cfg.name == "arith_tool":
        return ArithToolTask(cfg)
    if cfg.name == "math_jsonl":
        return MathJsonlTask(cfg)
    if cfg.name == "reasoning_gym":
        return ReasoningGymTask(cfg)
    if cfg.name == "verifiers":  # verifiers 0.4's stack (verifiers.v1) or the classic API (0.1-0.3)
        if is_v1_installed():
            return VerifiersV1Task(cfg)
        return VerifiersTask(cfg)
    if cfg.name == "openenv":
        return OpenEnvTask(cfg)
    raise ValueError(f"unknown task '{cfg.name}'; choose one of {list(TASKS)}")


__all__ = ["TASKS", "TaskConfig", "get_task"]
