"""`arith`: integer arithmetic problems generated from a seed, answered in `\\boxed{...}` (or, with
`answer_format: last_number`, as the last number of the reply).

Difficulty: operands are drawn uniformly from [0, 10**digits) (so they have 1..digits digits), `terms` operands,
operators drawn from `operators` (+, -, *; usual precedence). The held-out split is the first `eval_size` distinct
problems of its own seeded generator; the training stream skips those problems, so the two never overlap.

`scratchpad=True` is the generation-heavy variant: the number of terms varies in 2..terms and the target shows
column-by-column work (tens to a few hundred tokens) before the boxed answer.

Verifier: a reply is correct when its one `\\boxed{...}` holds the answer as an integer (spaces allowed) and only
whitespace follows the box. Junk after the box, a second box or an unclosed one is `no_answer` (`truncated` when
the length limit cut the reply off); a well-formed box with another number is `wrong`.
"""

from __future__ import annotations

import random
import re
from typing import Iterator

from inflight.config.tasks import TaskConfig
from inflight.contracts import TaskSample, Verification
from inflight.tasks.answer import check_answer_format, extract_answer, graded, unanswered

OPERATORS = ("+", "-", "*")
_INT = re.compile(r"^\s*([-+]?\d+)\s*$")


def evaluate(nums: list[int], ops: list[str]) -> int:
    """Value with the usual precedence (* before + and -); no eval() of text."""
    terms, signs = [nums[0]], [1]
    for op, n in zip(ops, nums[1:], strict=True):
        if op == "*":
            terms[-1] *= n
        else:
            terms.append(n)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


# ---- step-by-step work for the scratchpad variant ------------------------------------------------------------


def _add_steps(a: int, b: int) -> str:
    if a < 0:  # only happens after a subtraction went negative; keep it one line
        return f"{a}+{b}={a + b}"
    xs, ys, carry, parts = str(a)[::-1], str(b)[::-1], 0, []
    for i in range(max(len(xs), len(ys))):
        x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        s = x + y + carry
        parts.append(f"{x}+{y}{'+1' if carry else ''}={s}")
        carry = s // 10
    return f"{a}+{b}: {', '.join(parts)}. {a}+{b}={a + b}"


def _sub_steps(a: int, b: int) -> str:
    if a < 0:
        return f"{a}-{b}=-({-a}+{b})\n{_add_steps(-a, b)}\n{a}-{b}={a - b}"
    if a < b:
        return f"{a}-{b}=-({b}-{a})\n{_sub_steps(b, a)}\n{a}-{b}={a - b}"
    xs, ys, borrow, parts = str(a)[::-1], str(b)[::-1], 0, []
    for i in range(len(xs)):
        x, y = int(xs[i]) - borrow, int(ys[i]) if i < len(ys) else 0
        borrow = 1 if x < y else 0
        parts.append(f"{x + 10 * borrow}-{y}={x + 10 * borrow - y}")
    return f"{a}-{b}: {', '.join(parts)}. {a}-{b}={a - b}"


def _mul_steps(a: int, b: int) -> str:
    if b < 10 or a < 0:
        return f"{a}*{b}={a * b}"
    partial = [(int(d) * 10**i) for i, d in enumerate(str(b)[::-1]) if d != "0"]
    lines = [f"{a}*{p}={a * p}" for p in partial]
    lines.append(f"{'+'.join(str(a * p) for p in partial)}={a * b}")
    return f"{a}*{b}: {', '.join(lines)}. {a}*{b}={a * b}"


def scratchpad(nums: list[int], ops: list[str]) -> str:
    """Products first (left to right), then the sums and differences, then the boxed answer."""
    lines, terms, add_ops = [], [nums[0]], []
    for op, n in zip(ops, nums[1:], strict=True):
        if op == "*":
            lines.append(_mul_steps(terms[-1], n))
            terms[-1] *= n
        else:
            add_ops.append(op)
            terms.append(n)
    acc = terms[0]
    for op, n in zip(add_ops, terms[1:], strict=True):
        lines.append(_add_steps(acc, n) if op == "+" else _sub_steps(acc, n))
        acc = acc + n if op == "+" else acc - n
    lines.append(f"\\boxed{{{acc}}}")
    return "\n".join(lines)


def parse_expr(expr: str) -> tuple[list[int], list[str]]:
    toks = re.findall(r"\d+|[-+*]", expr)
    return [int(t) for t in toks[0::2]], toks[1::2]


# ---- the task -------------------------------------------------------------------------------------------------


class ArithTask:
    name = "arith"

    def __init__(self, cfg: TaskConfig):
        bad = [op for op in cfg.operators if op not in OPERATORS]
        if bad or not cfg.operators:
            raise ValueError(f"arith: operators must be a non-empty subset of {list(OPERATORS)}, got {cfg.operators}")
        if not 1 <= cfg.digits <= 18:
            raise ValueError(f"arith: digits must be in 1..18, got {cfg.digits}")
        if cfg.terms < 2:
            raise ValueError(f"arith: terms must be >= 2, got {cfg.terms}")
        if cfg.eval_size < 0:
            raise ValueError(f"arith: eval_size must be >= 0, got {cfg.eval_size}")
        check_answer_format(cfg.answer_format)
        self.cfg = cfg
        self._eval = self._make_eval()
        self._eval_exprs = {s.meta["expr"] for s in self._eval}

    def _problem(self, rng: random.Random) -> tuple[list[int], list[str]]:
        n = rng.randint(2, self.cfg.terms) if self.cfg.scratchpad else self.cfg.terms
        nums = [rng.randrange(10**self.cfg.digits) for _ in range(n)]
        return nums, [rng.choice(self.cfg.operators) for _ in range(n - 1)]

    def _sample(self, sid: str, nums: list[int], ops: list[str]) -> TaskSample:
        expr = str(nums[0]) + "".join(f"{op}{n}" for op, n in zip(ops, nums[1:], strict=True))
        if self.cfg.prompt:  # a short prompt makes every sample cheaper for a tiny model that learns the format
            question = self.cfg.prompt.replace("{expr}", expr)
        else:
            ask = "Work step by step, then put the answer in \\boxed{}." if self.cfg.scratchpad else "Answer in \\boxed{}."
            if self.cfg.answer_format == "last_number":
                ask = "Work step by step; end with the answer." if self.cfg.scratchpad else "Answer with the number only."
            question = f"What is {expr}? {ask}"
        system = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
        return TaskSample(
            id=sid,
            messages=[*system, {"role": "user", "content": question}],
            answer=str(evaluate(nums, ops)),
            meta={"expr": expr},
        )

    def _make_eval(self) -> list[TaskSample]:
        rng, seen, out = random.Random(f"arith-eval-{self.cfg.seed}"), set[str](), list[TaskSample]()
        for _ in range(50 * self.cfg.eval_size + 100):
            if len(out) == self.cfg.eval_size:
                return out
            s = self._sample(f"arith-eval-{self.cfg.seed}-{len(out)}", *self._problem(rng))
            if s.meta["expr"] not in seen:
                seen.add(s.meta["expr"])
                out.append(s)
        raise ValueError(f"arith: too few distinct problems for eval_size={self.cfg.eval_size}; raise digits/terms")

    def eval_samples(self) -> list[TaskSample]:
        return list(self._eval)

    def train_samples(self, seed: int) -> Iterator[TaskSample]:
        rng, i, skipped = random.Random(f"arith-train-{self.cfg.seed}-{seed}"), 0, 0
        while True:
            s = self._sample(f"arith-train-{seed}-{i}", *self._problem(rng))
            if s.meta["expr"] in self._eval_exprs:  # held-out problems never reach training
                skipped += 1
                if skipped > 10_000:
                    raise ValueError("arith: every generated problem is held out; lower eval_size or raise digits")
                continue
            skipped = 0
            i += 1
            yield s

    def solution(self, sample: TaskSample) -> str:
        """The correct target text (for SFT)."""
        if self.cfg.scratchpad:
            return scratchpad(*parse_expr(sample.meta["expr"]))
        return f"\\boxed{{{sample.answer}}}"

    def wrong_solution(self, sample: TaskSample, rng: random.Random) -> str:
        """A plausible wrong target: one digit nudged, or a random number of the same length."""
        value = int(sample.answer)
        if rng.random() < 0.5:
            wrong = value + rng.choice([-1, 1]) * 10 ** rng.randrange(max(1, len(str(abs(value)))))
        else:
            wrong = rng.randrange(10 ** max(1, len(str(abs(value)))))
        if wrong == value:
            wrong += 1
        right = self.solution(sample)
        return right[: right.rfind("\\boxed{")] + f"\\boxed{{{wrong}}}"

    def verify(self, completion: str, sample: TaskSample, finish_reason: str = "stop") -> Verification:
        """Correct: one `\\boxed{integer}` equal to the answer, with nothing but whitespace after it (strict: a tiny
        model that learns to append junk, or to hedge with a second box, earns nothing; see tasks/answer.py), or with
        `answer_format: last_number`, a finished reply whose last number is the answer."""
        boxed = extract_answer(completion, self.cfg.answer_format, finish_reason)
        if boxed is None:
            return unanswered(finish_reason)
        m = _INT.match(boxed)
        return graded(m is not None and int(m.group(1)) == int(sample.answer))
