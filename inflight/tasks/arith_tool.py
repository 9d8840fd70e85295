"""`arith_tool`: the arith problems (same generator, config and verifier) as multi-turn episodes with a calculator.

The model may write a tool call `<calc>123*456</calc>` in a turn; the environment evaluates it and answers with a
`tool` turn holding the result (`56088`, or `error: ...`); the model continues. The episode ends when a reply
holds a final `\\boxed{...}` answer (reward 1 when correct, else 0), when a reply holds neither a tool call nor an
answer (0), or when it runs out of turns (truncated, 0). With problems of several large operands
(digits: 4, terms: 3) the tool pays.

The calculator never evaluates text as code: the expression is parsed with `ast` and only integers, + - * // %
and parentheses (unary signs too) are computed, with bounded length and magnitude.
"""

from __future__ import annotations

import ast
import re

from inflight.config.tasks import TaskConfig
from inflight.contracts import StepResult, TaskSample
from inflight.tasks.answer import final_boxed
from inflight.tasks.arith import ArithTask

_CALL = re.compile(r"<calc>(.*?)(?:</calc>|$)", re.S)
DEMO_EXPR = "12*34"  # the worked example of task.tool_demo
MAX_EXPR_CHARS = 200
MAX_DIGITS = 200
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}


class CalcError(ValueError):
    pass


def calculate(expr: str) -> int:
    """Integer arithmetic over + - * // % and parentheses; CalcError for anything else."""
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip().replace("×", "*"), mode="eval")
    except SyntaxError:
        raise CalcError("not an arithmetic expression") from None

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and b == 0:
                raise CalcError("division by zero")
            v = _OPS[type(node.op)](a, b)
            if len(str(abs(v))) > MAX_DIGITS:
                raise CalcError("number too large")
            return v
        raise CalcError(f"unsupported: {type(node).__name__}")

    return ev(tree)


class CalcEnv:
    """One episode (contracts.Environment)."""

    def __init__(self, task: "ArithToolTask", sample: TaskSample):
        self.task, self.sample = task, sample

    def reset(self, sample: TaskSample) -> list[dict[str, str]]:
        return list(sample.messages)

    def step(self, reply: str) -> StepResult:
        if final_boxed(reply) is not None:
            v = self.task.verify(reply, self.sample)
            return StepResult(reward=float(v.reward), done=True)
        calls = _CALL.findall(reply)
        if not calls:
            return StepResult(reward=0.0, done=True)  # neither a tool call nor an answer
        try:
            out, err = str(calculate(calls[-1])), 0.0
        except CalcError as e:
            out, err = f"error: {e}", 1.0
        return StepResult(messages=[{"role": self.task.tool_role, "content": out}],
                          info={"tool_calls": 1.0, "tool_errors": err})


class ArithToolTask(ArithTask):
    name = "arith_tool"

    def __init__(self, cfg: TaskConfig):
        super().__init__(cfg)
        self.tool_role = cfg.tool_role

    def _sample(self, sid: str, nums: list[int], ops: list[str]) -> TaskSample:
        s = super()._sample(sid, nums, ops)
        s.messages[-1] = {"role": "user", "content": self._question(s.meta["expr"])}
        if self.cfg.tool_demo:
            s.messages[-1:-1] = [{"role": "user", "content": self._question(DEMO_EXPR)},
                                 {"role": "assistant", "content": f"<calc>{DEMO_EXPR}</calc>"},
                                 {"role": self.cfg.tool_role, "content": str(calculate(DEMO_EXPR))},
                                 {"role": "assistant", "content": f"\\boxed{{{calculate(DEMO_EXPR)}}}"}]
        return s

    def _question(self, expr: str) -> str:
        if self.cfg.prompt:
            return self.cfg.prompt.replace("{expr}", expr)
        return (f"What is {expr}? You may use a calculator: write <calc>expression</calc> and wait for the result. "
                "Put the final answer in \\boxed{}.")

    def make_env(self, sample: TaskSample) -> CalcEnv:
        return CalcEnv(self, sample)
