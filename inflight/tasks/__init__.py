"""Tasks with verifiable rewards: `get_task(cfg)` returns one by `cfg.name` (arith | arith_tool | math_jsonl |
reasoning_gym | verifiers). A task with `make_env` (contracts.EnvTask, e.g. arith_tool, verifiers) runs multi-turn
episodes."""

from __future__ import annotations

from inflight.contracts import Task
from inflight.tasks.config import TaskConfig

TASKS = ("arith", "arith_tool", "math_jsonl", "reasoning_gym", "verifiers")


def get_task(cfg: TaskConfig) -> Task:
    """Build the task named by cfg.name (imports only that task's dependencies)."""
    if cfg.name == "arith":
        from inflight.tasks.arith import ArithTask

        return ArithTask(cfg)
    if cfg.name == "arith_tool":
        from inflight.tasks.arith_tool import ArithToolTask

        return ArithToolTask(cfg)
    if cfg.name == "math_jsonl":
        from inflight.tasks.math_jsonl import MathJsonlTask

        return MathJsonlTask(cfg)
    if cfg.name == "reasoning_gym":
        from inflight.tasks.reasoning_gym_task import ReasoningGymTask

        return ReasoningGymTask(cfg)
    if cfg.name == "verifiers":  # verifiers 0.4's stack (verifiers.v1) or the classic API (0.1-0.3)
        from inflight.tasks.verifiers_v1 import VerifiersV1Task, is_v1_installed  # lazy: per task

        if is_v1_installed():
            return VerifiersV1Task(cfg)
        from inflight.tasks.verifiers_env import VerifiersTask

        return VerifiersTask(cfg)
    raise ValueError(f"unknown task '{cfg.name}'; choose one of {list(TASKS)}")


__all__ = ["TASKS", "TaskConfig", "get_task"]
