"""The actor as a process: what the pipeline launcher starts.

    ctx.Process(target=run_actor, args=(run_cfg, server_urls, stream, stop_event, metrics_queue.put)).start()

`run_actor` builds the task, the reward service and the server pool from the RunConfig, runs the actor until
`stop_event` is set or the pipeline's limits are reached, cleans up and returns the final metrics.
For sync mode (or any caller that drives the actor itself), `open_actor` gives the same Actor inside an existing
event loop:

    async with open_actor(run_cfg, server_urls, stream) as actor:
        groups = await actor.generate_round(run_cfg.actor.groups_per_step * run_cfg.pipeline.num_grad_steps)
"""

from __future__ import annotations

import asyncio
import inspect
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from inflight.actor.actor import Actor, MetricsSink
from inflight.actor.episode import EpisodeConfig, episode_rollout
from inflight.actor.rollout import RolloutFn, default_rollout
from inflight.actor.server_pool import ServerPool
from inflight.actor.turns import TurnRenderer
from inflight.config import RunConfig
from inflight.config.limits import pipeline_limits, staleness
from inflight.contracts import Stream
from inflight.engine.api.chat_template import use_chat_template
from inflight.process import freeze_startup_objects
from inflight.rewards import RewardService
from inflight.tasks import get_task
from inflight.trainer.weight_sync import protocol_of
from inflight.transport.schemas import served_adapter_name


def make_rewards(run_cfg: RunConfig) -> Any:
    a, algo = run_cfg.actor, run_cfg.algo
    return RewardService(run_cfg.task, workers=a.reward_workers, timeout_s=a.reward_timeout_s,
                         truncated=algo.truncated, overlong_penalty=algo.overlong_penalty,
                         overlong_buffer=algo.overlong_buffer)


async def _close(obj: Any) -> None:
    for name in ("aclose", "close", "shutdown"):
        fn = getattr(obj, name, None)
        if fn is not None:
            res = fn()
            if inspect.isawaitable(res):
                await res
            return


def env_rollout(run_cfg: RunConfig, task: Any) -> RolloutFn:
    """The episode rollout of an environment task, rendering the environment's turns with the servers' chat
    template (the tokenizer of model.path, with server.chat_template when set)."""
    from transformers import AutoTokenizer  # lazy: ~1.5 s to import; only a multi-turn task renders turns

    t = run_cfg.task
    tokenizer = AutoTokenizer.from_pretrained(run_cfg.model.path)
    use_chat_template(tokenizer, run_cfg.server.chat_template)
    render = TurnRenderer(tokenizer)
    return episode_rollout(task.make_env, render, EpisodeConfig(
        max_turns=t.max_turns, max_tokens=t.max_episode_tokens, env_timeout_s=t.env_timeout_s))


def served_names(run_cfg: RunConfig) -> Callable[[int], str | None] | None:
    """A LoRA run on stock vLLM servers (trainer.protocol=vllm): version v > 0 is served as its own adapter name
    (trainer/protocols/vllm_lora.py), version 0 as the base model; else None (the servers report versions)."""
    t = run_cfg.trainer
    if t.lora is None:
        return None
    if not getattr(protocol_of(run_cfg), "ADAPTER_PER_VERSION", False):
        return None
    prefix = t.lora.served_name
    return lambda v: served_adapter_name(prefix, v) if v > 0 else None


@asynccontextmanager
async def open_actor(
    run_cfg: RunConfig,
    server_urls: list[str],
    stream: Stream,
    metrics_sink: MetricsSink | None = None,
    *,
    rollout: RolloutFn = default_rollout,
    rewards: Any = None,  # a ready reward service; None = build one from the config (and close it after)
    resume: dict[str, Any] | None = None,  # {"next_group", "skipped", "dropped", "version"} of a trainer checkpoint
) -> AsyncIterator[Actor]:
    a = run_cfg.actor
    task = get_task(run_cfg.task)
    episodes = rollout is default_rollout and hasattr(task, "make_env")  # a multi-turn task: one sample per episode
    pool = ServerPool(
        server_urls, api_key=run_cfg.server.api_key or None, concurrency_per_server=a.concurrency_per_server,
        request_timeout_s=a.request_timeout_s, retries=a.retries, backoff_s=a.backoff_s,
        probe_interval_s=a.probe_interval_s, adapter=a.adapter,
    )
    # episodes come back scored by their environment: no reward service (its workers would build the task again)
    own_rewards = rewards is None and not episodes
    rewards = make_rewards(run_cfg) if own_rewards else rewards
    max_groups, max_seconds = pipeline_limits(run_cfg)
    if hasattr(rewards, "start"):  # spawn the verifier workers now, not inside the first score() on the loop
        await asyncio.to_thread(rewards.start)
    try:
        r = resume or {}
        if episodes:
            rollout = await asyncio.to_thread(env_rollout, run_cfg, task)
        yield Actor(a, task, pool, rewards, stream, rollout=rollout, seed=run_cfg.seed,
                    max_groups=max_groups, max_seconds=max_seconds, metrics_sink=metrics_sink,
                    first_group=int(r.get("next_group", 0)), groups_given_up=len(r.get("skipped", [])) + int(r.get("dropped", 0)),
                    min_version=int(r.get("version", -1)), served=served_names(run_cfg),
                    staleness=staleness(run_cfg))
    finally:
        await pool.aclose()
        if own_rewards:
            await _close(rewards)


def run_actor(
    run_cfg: RunConfig,
    server_urls: list[str],
    stream: Stream,
    stop_event: Any = None,  # anything with is_set(): threading / multiprocessing / asyncio Event
    metrics_sink: MetricsSink | None = None,  # called with {"kind": "actor"|"eval", ...}; must be picklable
    rollout: RolloutFn = default_rollout,  # to use it in a spawned process, define it at module level
    resume: dict[str, Any] | None = None,  # where a resumed run continues (see open_actor)
) -> dict[str, Any]:
    """Blocking entry point: run the pipelined actor until stopped or done; returns its final metrics
    (including "actor/groups_failed"; failures are also logged one by one)."""

    async def main() -> dict[str, Any]:
        async with open_actor(run_cfg, server_urls, stream, metrics_sink, rollout=rollout, resume=resume) as actor:
            freeze_startup_objects()  # the task's prompts, the imports: out of every later full collection
            final = await actor.run(stop_event)
            final["failures"] = actor.failures
            return final

    return asyncio.run(main())
