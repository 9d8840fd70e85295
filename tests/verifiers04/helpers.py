"""What the verifiers 0.4 tests share: the environments of tests/tasks/vf04_envs (written against `verifiers.v1`),
their task config, and each environment's reward computed here from the reply texts, independently of verifiers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from inflight.tasks import TaskConfig
from inflight.tasks.verifiers_v1 import is_v1_installed

ENVS = Path(__file__).resolve().parents[1] / "tasks" / "vf04_envs"
KINDS = {"single": "vf04_single.py", "retry": "vf04_retry.py", "tool": "vf04_tool.py"}

# these run in the verifiers 0.4 test venv (scripts/verifiers04-env.sh, `make test-verifiers04`); the project venv
# has verifiers 0.3.1, whose environments tests/tasks and tests/actor run
needs_v1 = pytest.mark.skipif(not is_v1_installed(), reason=(
    "verifiers 0.4 is not installed here: `make test-verifiers04` runs these in its test venv"))


def vf04_task(kind: str, **kw) -> TaskConfig:
    # env_timeout_s: a reset starts verifiers' harness program (a few seconds, more on a loaded machine)
    return TaskConfig(name="verifiers", **{"env": str(ENVS / KINDS[kind]), "eval_size": 4, "env_timeout_s": 120, **kw})


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (balanced braces), None without one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def calls_in(text: str) -> int:
    """How many <tool_call> blocks a reply holds (each one the environment answers with a tool message)."""
    return len(re.findall(r"<tool_call>", text))


def expected_reward(kind: str, replies: list[str], answer: str) -> float:
    """The environment's rubric, from the model's replies alone."""
    if kind == "single":
        return 1.0 if last_boxed(replies[-1]) == answer else 0.0
    if kind == "retry":
        text = "".join(replies)
        return sum(c.isdigit() for c in text) / len(text) if text else 0.0
    if kind == "tool":  # correct (weight 1) + used the calculator (weight 0.5): a reply with a call got a tool turn
        used = any(calls_in(r) for r in replies[:-1])
        return (1.0 if last_boxed(replies[-1]) == answer else 0.0) + 0.5 * used
    raise ValueError(kind)


def call(expr: str) -> str:
    return f"Let me compute.<tool_call>\n{json.dumps({'name': 'calc', 'arguments': {'expr': expr}})}\n</tool_call>"
