"""An environment task's `verify` (for tasks whose episodes are async): one reply scored as a whole episode's only
turn, which is what a single-turn evaluation asks of a multi-turn task; an environment that wants another turn after
it gives 0."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from inflight.contracts import StepResult, TaskSample, Verdict, Verification


async def _play(make_env: Callable[[TaskSample], Any], sample: TaskSample, completion: str) -> StepResult:
    env = make_env(sample)  # made on the loop that runs it
    try:
        opener = getattr(env, "open", None)  # optional: waits for a shared resource (contracts.Environment)
        if opener is not None:
            await opener()
        await env.reset(sample)
        return await env.step(completion)
    finally:
        await env.close()


def verify_one_turn(make_env: Callable[[TaskSample], Any], sample: TaskSample, completion: str,
                    finish_reason: str) -> Verification:
    res = asyncio.run(_play(make_env, sample, completion))
    if not res.done:
        return Verification(0.0, Verdict.no_answer if finish_reason != "length" else Verdict.truncated)
    return Verification(float(res.reward or 0.0), Verdict.correct if (res.reward or 0) > 0 else Verdict.wrong)
