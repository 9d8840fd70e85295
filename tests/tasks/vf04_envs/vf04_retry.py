"""A multi-turn environment written for verifiers 0.4: an `Env` whose episode is an exchange with the agent, the
environment answering every reply with a user turn "Try again." (`turns` model turns in all). Reward: the share of
digits among the characters of all replies (nonzero for a random model, so a short training run has something to
learn from)."""

from __future__ import annotations

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness


class RetryTask(vf.Task):
    @vf.reward
    async def digit_share(self, trace: vf.Trace) -> float:
        text = "".join(m.content or "" for m in trace.assistant_messages)
        return sum(c.isdigit() for c in text) / len(text) if text else 0.0


class RetryTaskset(vf.Taskset[RetryTask, vf.TasksetConfig]):
    def load(self):
        for i in range(12):
            yield RetryTask(vf.TaskData(prompt=f"Write the number {100 + 37 * i} in digits."), self.config.task)


class RetryConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    turns: int = 3


class RetryEnv(vf.Env[RetryConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as chat:
            await chat.turn()  # the task's prompt speaks first
            for _ in range(self.config.turns - 1):
                await chat.turn("Try again.")


class RetryChat(NullHarness):
    """The plain chat loop; each user turn resumes it on the conversation so far."""


__all__ = ["RetryChat", "RetryEnv", "RetryTaskset"]
