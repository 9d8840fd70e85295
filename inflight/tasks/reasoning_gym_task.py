"""`reasoning_gym`: any procedural dataset of the reasoning-gym package, scored by the dataset's own scorer.

The model answers in `\\boxed{...}`; the boxed text goes to `dataset.score_answer`. All 105 single datasets of
reasoning-gym 0.1.19 generate offline (checked); `composite` needs a list of datasets and is not supported here.
A sample records (seed, index) so it can be regenerated for scoring in any process.

Verifier: as math_jsonl's, the reply's one box must end it (only whitespace, `$`, `\\]`, `\\)`, `**` or a full stop
after it); otherwise `no_answer` (`truncated` when cut off by the length limit). The scorer's partial credit is kept.
"""

from __future__ import annotations

import difflib
from functools import lru_cache
from typing import Any, Iterator

from inflight.config.tasks import TaskConfig
from inflight.contracts import TaskSample, Verdict, Verification
from inflight.tasks.answer import MATH_TRAILER, final_boxed, unanswered

INSTRUCTION = "Put your final answer in \\boxed{}."
TRAIN_CHUNK = 10_000  # training datasets are generated in chunks of this size, each with its own seed
UNSUPPORTED = {"composite": "it mixes other datasets and needs their list; name one dataset instead"}


@lru_cache(maxsize=64)
def _dataset(name: str, seed: int, size: int) -> Any:
    import reasoning_gym  # lazy: ~2.5 s to import (every dataset); only this task needs it

    return reasoning_gym.create_dataset(name, seed=seed, size=size)


class ReasoningGymTask:
    name = "reasoning_gym"

    def __init__(self, cfg: TaskConfig):
        from reasoning_gym.factory import DATASETS  # lazy: as reasoning_gym above (seconds to import)

        if cfg.answer_format != "boxed":  # its prompts ask for \boxed{}
            raise ValueError(f"reasoning_gym: task.answer_format must be 'boxed', got {cfg.answer_format!r}")
        if cfg.dataset in UNSUPPORTED:
            raise ValueError(f"reasoning_gym: dataset '{cfg.dataset}' is not supported: {UNSUPPORTED[cfg.dataset]}")
        if cfg.dataset not in DATASETS:
            close = difflib.get_close_matches(cfg.dataset, list(DATASETS), n=3)
            raise ValueError(f"reasoning_gym: unknown dataset '{cfg.dataset}'; close names: {close}")
        self.cfg = cfg
        self._eval = [self._sample("eval", self._eval_seed, cfg.eval_size, i) for i in range(cfg.eval_size)]
        self._eval_questions = {s.meta["question"] for s in self._eval}

    @property
    def _eval_seed(self) -> int:
        return 1_000_003 * (self.cfg.seed + 1)  # far from every training chunk's seed

    def _sample(self, split: str, seed: int, size: int, index: int) -> TaskSample:
        entry = _dataset(self.cfg.dataset, seed, size)[index]
        messages = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
        messages.append({"role": "user", "content": f"{entry['question']}\n{INSTRUCTION}"})
        return TaskSample(
            id=f"{self.cfg.dataset}-{split}-{seed}-{index}",
            messages=messages,
            answer="" if entry["answer"] is None else str(entry["answer"]),  # None: many answers are valid
            meta={"rg_seed": seed, "rg_size": size, "rg_index": index, "question": entry["question"]},
        )

    def eval_samples(self) -> list[TaskSample]:
        return list(self._eval)

    def train_samples(self, seed: int) -> Iterator[TaskSample]:
        chunk = 0
        while True:
            chunk_seed = self.cfg.seed * 7919 + seed * 104_729 + chunk
            for i in range(TRAIN_CHUNK):
                s = self._sample("train", chunk_seed, TRAIN_CHUNK, i)
                if s.meta["question"] not in self._eval_questions:
                    yield s
            chunk += 1

    def solution(self, sample: TaskSample) -> str:
        return f"\\boxed{{{sample.answer}}}"

    def verify(self, completion: str, sample: TaskSample, finish_reason: str = "stop") -> Verification:
        boxed = final_boxed(completion, MATH_TRAILER)
        if boxed is None:
            return unanswered(finish_reason)
        try:
            m = sample.meta
            ds = _dataset(self.cfg.dataset, m["rg_seed"], m["rg_size"])
            score = float(ds.score_answer(boxed.strip(), ds[m["rg_index"]]))
        except Exception:  # noqa: BLE001 - a scorer failure must not kill the actor
            return Verification(reward=0.0, label=Verdict.error)
        return Verification(reward=score, label=Verdict.correct if score >= 1.0 else Verdict.wrong)
