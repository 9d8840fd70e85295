"""A tool environment written for verifiers 0.4: a calculator served as an MCP tool (`vf.Toolset`, one server
shared by the taskset's rollouts), multiplications to solve. Reward: 1 for the right \\boxed{} answer + 0.5 when
the calculator was used. verifiers starts the tool server as `python -m vf04_tool`."""

from __future__ import annotations

import ast
import operator

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expr: str) -> int:
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported expression: {expr!r}")

    return ev(ast.parse(expr, mode="eval"))


class Calculator(vf.Toolset[vf.SharedToolsetConfig, vf.State]):
    TOOL_PREFIX = None  # the tool is called `calc`

    @vf.tool
    async def calc(self, expr: str) -> str:
        """Integer arithmetic, e.g. 12*34."""
        return str(evaluate(expr))


class MulData(vf.TaskData):
    answer: str


class MulTask(vf.Task[MulData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: MulData, trace: vf.Trace) -> float:
        return 1.0 if vf.extract_boxed_answer(trace.last_reply) == task.answer else 0.0

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return 1.0 if trace.tool_messages else 0.0


class MulTaskset(vf.Taskset[MulTask, vf.TasksetConfig]):
    def load(self):
        for i in range(12):
            a, b = 11 + 7 * i % 89, 13 + 5 * i % 83
            yield MulTask(MulData(prompt=f"What is {a}*{b}? Use the calculator, then put the answer in \\boxed{{}}.",
                                  system_prompt="Use the calculator.", answer=str(a * b)), self.config.task)

    @classmethod
    def toolsets(cls, config: vf.TasksetConfig) -> list[vf.Toolset]:
        return [Calculator(vf.SharedToolsetConfig())]


class MulChat(NullHarness):
    """The plain chat loop: it lists the MCP tools to the model and runs its calls until a reply calls none."""


__all__ = ["MulChat", "MulTaskset"]

if __name__ == "__main__":
    Calculator.run()
