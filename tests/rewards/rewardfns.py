"""Verifiers for the reward-service tests (importable by the spawned workers: pytest puts this folder on sys.path)."""

from __future__ import annotations

import os
import time

from inflight.contracts import TaskSample, Verdict, Verification


def verify(completion: str, sample: TaskSample, finish_reason: str = "stop") -> Verification:
    """Exact-match verifier with failure modes chosen by the completion text."""
    if completion == "hang":
        time.sleep(1e6)
    if completion == "raise":
        raise ZeroDivisionError("verifier bug")
    if completion == "crash":
        os._exit(3)
    if completion == "partial":
        return Verification(reward=0.25, label=Verdict.wrong)
    if not completion:
        return Verification(0.0, Verdict.truncated if finish_reason == "length" else Verdict.no_answer)
    ok = completion.strip() == sample.answer
    return Verification(1.0 if ok else 0.0, Verdict.correct if ok else Verdict.wrong)


def pid_verify(completion: str, sample: TaskSample, finish_reason: str = "stop") -> Verification:
    """Reward = the worker's pid, to see that work runs in other processes."""
    return Verification(float(os.getpid()), Verdict.correct)
