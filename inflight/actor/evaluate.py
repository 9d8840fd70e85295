"""Held-out evaluation through the same inference servers: one sample per problem (greedy by default), pass@1 and
mean reward, tagged with the weight version(s) whose tokens were scored, with the replies' lengths and the first
few replies as text (the report shows them), and the accuracy's binomial standard error. An in-run evaluation may
score a rotating subset of the split (`subset`, `round_index`: eval_subset.py). Only a finished reply counts as
correct: one the length limit cut off is `truncated` here whatever its text, in every `algo.truncated` mode. A
multi-turn task evaluates whole episodes (`episode`, actor/episode.py), scored by their environment, and reports the
mean tool calls per episode."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from typing import Any, Awaitable, Callable

from inflight import backends
from inflight.actor.eval_subset import binomial_stderr, rotating_subset
from inflight.actor.response_parsers import Completion
from inflight.actor.rollout import RolloutClient
from inflight.actor.server_pool import ServerPool
from inflight.algo.truncation import is_truncated
from inflight.config.actor import ActorConfig
from inflight.contracts import Sample, Task, TaskSample, Verdict, Verification


async def _verify_all(task: Task, items: list[tuple[str, TaskSample, str, int, int]]) -> list[Verification]:
    """Fallback without a reward service: the task's own verifier, off the event loop."""
    return await asyncio.to_thread(lambda: [task.verify(text, ts, fr) for text, ts, fr, _, _ in items])


async def evaluate(
    task: Task,
    pool: ServerPool,
    cfg: ActorConfig,
    *,
    rewards: Any = None,  # a RewardService (async score); None = task.verify in a thread
    model: str | None = None,  # None = the name the servers report
    limit: int = 0,  # 0 = the whole held-out split
    episode: Callable[[TaskSample, RolloutClient], Awaitable[Sample]] | None = None,  # multi-turn tasks
    served: Callable[[int], str | None] | None = None,  # stock vLLM LoRA: version -> adapter name (rollout.py)
    version: int | Callable[[], int] | None = None,  # ... and the version to ask for (a callable: the newest)
    subset: int = 0,  # score this many problems (0 = all), the round_index-th window of the rotation
    round_index: int = 0,
) -> dict[str, Any]:
    """Returns {"pass@1", "stderr", "mean_reward", "num_problems", "subset_start", "split_size", "num_failed",
    "labels", "version_min", "version_max", "completion_len_mean", "completion_len_max", "prompt_tokens",
    "completion_tokens", "truncated_frac", "replies", "seconds"}; version_min/max span the weight versions of every scored token (equal when no update happened during
    the evaluation); `replies` holds the first `cfg.eval_samples` scored problems' prompt, reply, finish reason,
    token count and label. Problems whose request failed count as wrong (reward 0) and in num_failed."""
    problems = task.eval_samples()
    if limit:
        problems = problems[:limit]
    if not problems:
        raise ValueError(f"task '{task.name}' has no held-out problems")
    total = len(problems)
    problems = rotating_subset(problems, subset, round_index)
    start = (round_index * subset) % total if 0 < subset < total else 0
    client = RolloutClient(pool, cfg, model, served=served, version=version)
    max_tokens = cfg.eval_max_new_tokens or cfg.max_new_tokens
    # stock vLLM / SGLang reject a priority unless started with priority scheduling
    extra = {"priority": cfg.eval_priority} if cfg.adapter == backends.BUILTIN and cfg.eval_priority else {}
    t0 = time.monotonic()

    async def one(ts: TaskSample) -> Completion | None:
        try:
            return (await client.chat(ts.messages, n=1, max_tokens=max_tokens, temperature=cfg.eval_temperature,
                                      **extra))[0]
        except Exception:
            return None

    if episode is not None:  # a multi-turn task: each problem is one episode, scored by its environment
        eclient = RolloutClient(pool, dataclasses.replace(cfg, temperature=cfg.eval_temperature,
                                                          max_new_tokens=max_tokens), model, served=served,
                               version=version)
        episodes: dict[str, Sample] = {}

        async def one(ts: TaskSample) -> Completion | None:  # noqa: F811 - the episode variant
            try:
                s = episodes[ts.id] = await episode(ts, eclient)
            except Exception:
                return None
            mask = s.loss_mask or [1] * len(s.completion_ids)  # the model's tokens only
            pick = [j for j, m in enumerate(mask) if m]
            return Completion(s.meta.get("text", ""), s.prompt_ids, [s.completion_ids[j] for j in pick],
                              [s.logprobs[j] for j in pick], [s.versions[j] for j in pick], s.finish_reason)

    outs = await asyncio.gather(*(one(ts) for ts in problems))
    ok = [(c, ts) for c, ts in zip(outs, problems, strict=True) if c is not None]
    if episode is not None:
        verdicts = [Verification(episodes[ts.id].reward, Verdict(episodes[ts.id].label)) for _, ts in ok]
        tool_calls = [float(episodes[ts.id].meta.get("tool_calls", 0.0)) for _, ts in ok]
    else:
        items = [(c.text, ts, c.finish_reason, len(c.token_ids), max_tokens) for c, ts in ok]
        verdicts = await (rewards.score(items) if rewards is not None else _verify_all(task, items)) if items else []
    # finished replies only: a cut-off one is never correct here, whatever the training's truncation mode
    names = [Verdict.truncated.value if is_truncated(c.finish_reason) else getattr(v.label, "value", str(v.label))
             for (c, _), v in zip(ok, verdicts, strict=True)]
    labels = Counter(names)
    versions = [v for c, _ in ok for v in c.versions]
    lengths = [len(c.token_ids) for c, _ in ok]
    n = len(problems)
    acc = labels.get("correct", 0) / n
    return {
        "pass@1": acc,
        "stderr": binomial_stderr(acc, n),
        "subset_start": start,  # the window's first problem; num_problems < the split's size = a subset
        "split_size": total,
        "mean_reward": sum(float(v.reward) for v in verdicts) / n,
        "num_problems": n,
        "num_failed": n - len(ok),
        "labels": dict(labels),
        "version_min": min(versions) if versions else -1,
        "version_max": max(versions) if versions else -1,
        "completion_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        "completion_len_max": max(lengths, default=0),
        "prompt_tokens": sum(len(c.prompt_ids) for c, _ in ok),  # what the servers prefilled and generated for it
        "completion_tokens": sum(lengths),
        "truncated_frac": sum(is_truncated(c.finish_reason) for c, _ in ok) / max(1, len(ok)),
        "replies": [{"prompt": ts.messages[-1]["content"], "reply": c.text, "finish": c.finish_reason,
                     "tokens": len(c.token_ids), "label": label}
                    for (c, ts), label in list(zip(ok, names, strict=True))[: cfg.eval_samples]],
        "seconds": time.monotonic() - t0,
        **({"tool_calls_mean": sum(tool_calls) / max(1, len(tool_calls))} if episode is not None else {}),
    }
