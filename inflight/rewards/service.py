"""RewardService: scores completions with the task's `verify`, off the event loop, in killable worker processes.

    rewards = RewardService(cfg.task, workers=2, timeout_s=10.0, truncated="soft_penalty", overlong_penalty=0.5)
    verdicts = await rewards.score([(text, task_sample, finish_reason, num_tokens, max_tokens), ...])

Failures: a verifier that raises, crashes its process, or runs past `timeout_s` gives the `error` label (reward
`reward_table["error"]`, 0 by default) and a log line; a hung or dead worker is killed and replaced, so later
calls work as before. `error` rather than `no_answer`: the completion may well hold an answer; the verifier failed.

Reward of one completion = reward_table[label] for the labels the table names, else the verifier's own reward (the
built-in tasks give correct 1, anything else 0; reasoning-gym may give partial credit); then the truncation mode
(`algo.truncated`, inflight/algo/truncation.py) for a completion cut off by the length limit:
  zero_reward   label `truncated`, reward reward_table["truncated"] (0 unless set);
  soft_penalty  minus overlong_penalty * clip((num_tokens - (max_tokens - B)) / B, 0, 1), B = overlong_buffer *
                max_tokens, on every completion (DAPO's soft overlong punishment); the label is never changed;
  mask, keep    the reward as above (`mask` acts in the trainer).
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from inflight.algo import truncation
from inflight.config.tasks import TaskConfig
from inflight.contracts import TaskSample, Verdict, Verification
from inflight.rewards.pool import KillablePool, log
from inflight.tasks import get_task

# (completion text, the TaskSample it answers, finish_reason, completion tokens, max new tokens of the request)
ScoreItem = tuple[str, TaskSample, str, int, int]


def import_object(path: str) -> Any:
    """'package.module:name' or 'package.module.name' -> the object."""
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    if not module or not name:
        raise ValueError(f"'{path}' is not an import path like 'package.module:function'")
    return getattr(importlib.import_module(module), name)


def _build_verifier(task_cfg: TaskConfig, verify_fn: str | None) -> Callable[[list], list]:
    """Runs once in each worker: the task's verify (or a user function) over a batch of (completion, sample,
    finish_reason), giving per item ("ok", (reward, label)) or ("raised", message): one item that raises does not
    fail the others."""
    if verify_fn:
        verify = import_object(verify_fn)
    else:
        verify = get_task(task_cfg).verify

    def run(items: list[tuple[str, TaskSample, str]]) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for completion, sample, finish_reason in items:
            try:
                v = verify(completion, sample, finish_reason)
                out.append(("ok", (float(v.reward), Verdict(v.label).value)))
            except Exception as exc:  # noqa: BLE001 - labelled 'error' by the caller
                out.append(("raised", f"{type(exc).__name__}: {exc}"))
        return out

    return run


class RewardService:
    def __init__(
        self,
        task_cfg: TaskConfig,
        *,
        workers: int = 2,
        timeout_s: float = 10.0,
        reward_table: dict[str, float] | None = None,
        truncated: str = "zero_reward",  # algo.truncated
        overlong_penalty: float = 1.0,
        overlong_buffer: float = 0.2,
        verify_fn: str | None = None,
        start_timeout_s: float = 120.0,
    ):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0 (got {workers}, {timeout_s})")
        truncation.check(truncated, overlong_penalty, overlong_buffer)
        table = {str(getattr(k, "value", k)): float(v) for k, v in (reward_table or {}).items()}
        unknown = set(table) - {v.value for v in Verdict}
        if unknown:
            raise ValueError(f"reward_table has unknown labels {sorted(unknown)}; labels: {[v.value for v in Verdict]}")
        self.task_cfg, self.workers, self.timeout_s = task_cfg, workers, timeout_s
        self.reward_table, self.truncated = table, truncated
        self.overlong_penalty, self.overlong_buffer = overlong_penalty, overlong_buffer
        self.verify_fn, self.start_timeout_s = verify_fn, start_timeout_s
        self.stats: collections.Counter[str] = collections.Counter()  # calls, and timeout / crashed / raised
        self._pool: KillablePool | None = None
        self._threads: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()

    # ---- lifecycle ----
    def start(self) -> None:
        """Start the worker processes (each builds the task once); blocking. score() calls it on first use.
        A task or verify_fn that fails to build raises RuntimeError here, with the worker's message."""
        with self._lock:
            if self._pool is None:
                self._pool = KillablePool(
                    _build_verifier, (self.task_cfg, self.verify_fn), self.workers, self.start_timeout_s
                )
                self._threads = ThreadPoolExecutor(self.workers, thread_name_prefix="reward")

    def close(self) -> None:
        with self._lock:
            if self._threads is not None:
                self._threads.shutdown(wait=False, cancel_futures=True)
            if self._pool is not None:
                self._pool.close()
            self._pool = self._threads = None

    def __enter__(self) -> "RewardService":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def replaced_workers(self) -> int:
        return self._pool.replaced if self._pool else 0

    # ---- rewards ----
    def penalty(self, num_tokens: int, max_tokens: int) -> float:
        """The soft overlong penalty of a completion of num_tokens (0 unless truncated="soft_penalty")."""
        if self.truncated != "soft_penalty":
            return 0.0
        return truncation.overlong_penalty(num_tokens, max_tokens, self.overlong_penalty, self.overlong_buffer)

    def verdict(self, label: Verdict, verifier_reward: float, finish_reason: str, num_tokens: int,
                max_tokens: int) -> Verification:
        """The final reward and label of one completion (see the module docstring)."""
        if self.truncated == "zero_reward" and truncation.is_truncated(finish_reason):
            return Verification(reward=self.reward_table.get(Verdict.truncated.value, 0.0), label=Verdict.truncated)
        base = self.reward_table.get(label.value, verifier_reward)
        return Verification(reward=base - self.penalty(num_tokens, max_tokens), label=label)

    def _outcomes(self, items: list[ScoreItem]) -> list[tuple[str, Any]]:
        """One pool call for the whole batch (a group's completions: one pipe round trip instead of one per
        completion). A batch that hangs past timeout_s or kills its worker is scored again one item per call, so
        only the item at fault gets the error label (at most 2 x timeout_s for that item)."""
        assert self._pool is not None
        outcome, value = self._pool.call(([(c, s, f) for c, s, f, _, _ in items],), self.timeout_s)
        if outcome == "ok":
            return value
        if len(items) == 1:
            return [(outcome, value)]
        return [self._outcomes([item])[0] for item in items]

    def _score_batch(self, items: list[ScoreItem]) -> list[Verification]:
        out = []
        outcomes = self._outcomes(items)
        for (_, sample, finish, num_tokens, max_tokens), (outcome, value) in zip(items, outcomes, strict=True):
            with self._stats_lock:
                self.stats["calls"] += 1
                if outcome != "ok":
                    self.stats[outcome] += 1
            if outcome == "ok":
                verifier_reward, label = value[0], Verdict(value[1])
            else:
                log.warning("verifier %s on task sample %r: %s -> label 'error'", outcome, sample.id, value)
                verifier_reward, label = 0.0, Verdict.error
            out.append(self.verdict(label, verifier_reward, finish, num_tokens, max_tokens))
        return out

    def _batches(self, completions: list[ScoreItem]) -> list[list[ScoreItem]]:
        """Up to one batch per worker, in order."""
        size = -(-len(completions) // self.workers)
        return [completions[i : i + size] for i in range(0, len(completions), size)]

    async def score(self, completions: list[ScoreItem]) -> list[Verification]:
        """Verify the completions in the worker pool (never on the event loop); results in input order."""
        if not completions:
            return []
        if self._pool is None:
            await asyncio.to_thread(self.start)
        loop = asyncio.get_running_loop()
        jobs = [loop.run_in_executor(self._threads, self._score_batch, b) for b in self._batches(completions)]
        return [v for batch in await asyncio.gather(*jobs) for v in batch]

    def score_sync(self, completions: list[ScoreItem]) -> list[Verification]:
        """Blocking variant for code without an event loop."""
        if not completions:
            return []
        self.start()
        assert self._threads is not None
        return [v for batch in self._threads.map(self._score_batch, self._batches(completions)) for v in batch]
