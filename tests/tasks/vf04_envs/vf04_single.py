"""A single-turn environment written for verifiers 0.4 (`verifiers.v1`), as a taskset package ships one: a module
exporting its Taskset (and the chat-loop harness it runs with) via `__all__`. Additions; reward 1 for the right
\\boxed{} answer. The tests run it through inflight (task.name=verifiers, task.env=<this file>)."""

from __future__ import annotations

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return 1.0 if vf.extract_boxed_answer(trace.last_reply) == task.answer else 0.0


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 12


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            a, b = 11 + 7 * i % 89, 13 + 5 * i % 83
            yield SumTask(SumData(prompt=f"What is {a}+{b}? Put the answer in \\boxed{{}}.", answer=str(a + b)),
                          self.config.task)


class SumChat(NullHarness):
    """The plain chat loop (no tools of its own): one reply ends the episode."""


__all__ = ["SumChat", "SumTaskset"]
