"""Tiny environments written for the verifiers library (classic API), as an environment package would ship them:
a module with `load_environment(**kwargs)`. The tests run them through inflight's adapter (task.name=verifiers,
task.env=<this file>).

    kind="tool":   vf.ToolEnv, a calculator tool; reward 1 for the right \\boxed{} answer + 0.5 when a tool was used
    kind="single": vf.SingleTurnEnv, additions; reward 1 for the right \\boxed{} answer (an async reward function)
    kind="retry":  vf.MultiTurnEnv that answers every reply with a user turn "Try again." for up to max_turns
                   turns; reward = the share of digits among the characters of all replies (nonzero for a random
                   model, so a short training run has something to learn from)
"""

from __future__ import annotations

import ast
import operator

import verifiers as vf
from datasets import Dataset

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calc(expr: str) -> str:
    """Integer arithmetic.

    Args:
        expr: e.g. 12*34
    """
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported expression: {expr!r}")

    return str(ev(ast.parse(expr, mode="eval")))


def _rows(n: int, op: str, start: int) -> list[dict]:
    rows = []
    for i in range(start, start + n):
        a, b = 11 + 7 * i % 89, 13 + 5 * i % 83
        rows.append({"question": f"What is {a}{op}{b}? Put the answer in \\boxed{{}}.",
                     "answer": str(a * b if op == "*" else a + b)})
    return rows


def boxed_answer(completion, answer, parser) -> float:
    return 1.0 if parser.parse_answer(completion) == answer else 0.0


async def async_boxed_answer(completion, answer, parser) -> float:
    return boxed_answer(completion, answer, parser)


async def used_tool(state) -> float:
    return 1.0 if any(m.role == "tool" for m in state["completion"]) else 0.0


def digit_share(completion) -> float:
    text = "".join(m.content or "" for m in completion if m.role == "assistant")
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


class RetryEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Try again."}]


def load_environment(kind: str = "tool", num_train: int = 16, num_eval: int = 4, max_turns: int = 3):
    parser = vf.Parser(extract_fn=vf.extract_boxed_answer)
    if kind == "tool":
        rubric = vf.Rubric(funcs=[boxed_answer, used_tool], weights=[1.0, 0.5], parser=parser)
        return vf.ToolEnv(dataset=Dataset.from_list(_rows(num_train, "*", 0)),
                          eval_dataset=Dataset.from_list(_rows(num_eval, "*", 1000)),
                          system_prompt="Use the calculator.", tools=[calc], max_turns=max_turns,
                          parser=parser, rubric=rubric)
    if kind == "single":  # no eval dataset: inflight holds out the last task.eval_size rows
        rubric = vf.Rubric(funcs=[async_boxed_answer], parser=parser)
        return vf.SingleTurnEnv(dataset=Dataset.from_list(_rows(num_train, "+", 0)), parser=parser, rubric=rubric)
    if kind == "retry":
        rubric = vf.Rubric(funcs=[digit_share], parser=parser)
        return RetryEnv(dataset=Dataset.from_list(_rows(num_train, "+", 0)),
                        eval_dataset=Dataset.from_list(_rows(num_eval, "+", 1000)),
                        max_turns=max_turns, parser=parser, rubric=rubric)
    raise ValueError(f"unknown kind {kind!r}")
