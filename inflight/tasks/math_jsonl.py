"""`math_jsonl`: problems from a local .jsonl or .parquet file, checked with math-verify.

GSM8K-style answers ("... #### 42") keep the part after `####`. The held-out split is `eval_path`, or else the last
`eval_size` rows of `path`. The model answers in `\\boxed{...}`; the boxed text is compared with the gold answer by
math-verify (so `\\frac{1}{2}` equals `0.5`).

Verifier: the reply's one box must end it; after the box only whitespace, closing math delimiters (`$`, `\\]`,
`\\)`), `**` and a full stop ("the answer is $\\boxed{18}$."). Anything else after it, a second box or an unclosed one
is `no_answer` (`truncated` when cut off by the length limit); an empty box is `no_answer`.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from pathlib import Path
from typing import Any, Iterator

from inflight.config.tasks import TaskConfig
from inflight.contracts import TaskSample, Verdict, Verification
from inflight.tasks.answer import MATH_TRAILER, final_boxed, graded, unanswered

logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call made with timeouts disabled
INSTRUCTION = "Put your final answer in \\boxed{}."


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"math_jsonl: no such file: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # lazy: pyarrow costs ~0.3 s to import and only parquet files need it

        return pq.read_table(path).to_pylist()
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"math_jsonl: expected a .jsonl or .parquet file, got {path.name}")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"math_jsonl: {path}:{n} is not valid JSON: {exc}") from None
    return rows


def gold_answer(raw: Any) -> str:
    """The final answer of a gold solution: GSM8K's '... #### 1,234' becomes '1234'."""
    text = str(raw).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    return text


def _latex(text: str) -> str:
    return text if "$" in text else f"${text}$"  # math-verify needs delimiters to parse e.g. \sqrt{8}


class MathJsonlTask:
    name = "math_jsonl"

    def __init__(self, cfg: TaskConfig):
        if not cfg.path:
            raise ValueError("math_jsonl: set task.path to a .jsonl or .parquet file")
        if cfg.answer_format != "boxed":  # its prompts ask for \boxed{}
            raise ValueError(f"math_jsonl: task.answer_format must be 'boxed', got {cfg.answer_format!r}")
        self.cfg = cfg
        rows = self._samples(load_rows(cfg.path), "train")
        if cfg.eval_path:
            self._train, self._eval = rows, self._samples(load_rows(cfg.eval_path), "eval")
        else:
            if len(rows) <= cfg.eval_size:
                raise ValueError(f"math_jsonl: {cfg.path} has {len(rows)} rows, not more than eval_size={cfg.eval_size}")
            cut = len(rows) - cfg.eval_size
            self._train, self._eval = rows[:cut], rows[cut:]
        self._gold_cache: dict[str, Any] = {}

    def _samples(self, rows: list[dict[str, Any]], split: str) -> list[TaskSample]:
        q, a = self.cfg.question_field, self.cfg.answer_field
        out = []
        for i, row in enumerate(rows):
            if q not in row or a not in row:
                raise ValueError(f"math_jsonl: row {i} lacks field '{q}' or '{a}'; its fields are {sorted(row)}")
            messages = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
            messages.append({"role": "user", "content": f"{row[q]}\n{INSTRUCTION}"})
            out.append(TaskSample(id=f"{split}-{i}", messages=messages, answer=gold_answer(row[a])))
        return out

    def eval_samples(self) -> list[TaskSample]:
        return list(self._eval)

    def train_samples(self, seed: int) -> Iterator[TaskSample]:
        return shuffled_forever(self._train, f"math-{self.cfg.seed}-{seed}")

    def solution(self, sample: TaskSample) -> str:
        return f"\\boxed{{{sample.answer}}}"

    def verify(self, completion: str, sample: TaskSample, finish_reason: str = "stop") -> Verification:
        boxed = final_boxed(completion, MATH_TRAILER)
        if boxed is None or not boxed.strip():
            return unanswered(finish_reason)
        from math_verify import parse, verify  # lazy: ~1 s to import; only scoring needs it, not the actor

        # math-verify times out with signals, which only work on the main thread
        main = threading.current_thread() is threading.main_thread()
        timeout = 5 if main else None
        try:
            if sample.answer not in self._gold_cache:
                self._gold_cache[sample.answer] = parse(_latex(sample.answer), parsing_timeout=timeout)
            gold = self._gold_cache[sample.answer]
            pred = parse(_latex(boxed), parsing_timeout=timeout)
            if not gold:
                return Verification(reward=0.0, label=Verdict.error)  # the gold answer itself does not parse
            if not pred:
                return graded(False)  # an answer was given but is not mathematics
            return graded(bool(verify(gold, pred, timeout_seconds=timeout)))
        except Exception:  # noqa: BLE001 - a verifier failure must not kill the actor
            return Verification(reward=0.0, label=Verdict.error)


def shuffled_forever(rows: list[TaskSample], key: str) -> Iterator[TaskSample]:
    """The rows without end, a fresh shuffle (seeded by key and the pass number) each pass."""
    epoch = 0
    while True:
        order = list(range(len(rows)))
        random.Random(f"{key}-{epoch}").shuffle(order)
        for i in order:
            yield rows[i]
        epoch += 1
