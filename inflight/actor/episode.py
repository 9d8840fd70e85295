"""Multi-turn episodes: one Sample per episode, the model's tokens exactly as sampled.

    rollout = episode_rollout(task.make_env, TurnRenderer(tokenizer), EpisodeConfig(max_turns=4))
    Actor(cfg, task, pool, rewards, stream, rollout=rollout)

An episode (`run_episode`) alternates the model and an `Environment` (inflight.contracts):

    messages = env.reset(task_sample)                    first turn: POST /v1/chat/completions (server renders;
                                                         with env.tools, see `first_request`)
    loop: result = env.step(reply text)                  tool output / next user turn, reward, done
          ids += TurnRenderer.delta(...)                 the env's turn, rendered once (loss mask 0)
          next turn: POST /v1/completions, prompt = every token id of the episode so far

The Sample holds prompt_ids = the first prompt and completion_ids = everything after it: each model turn's token
ids with their behaviour logprobs and weight versions as the server returned them (loss_mask 1), and between
turns the environment's tokens (loss_mask 0, logprob 0.0, version -1). The model's tokens are never re-rendered
from text, so the trainer scores exactly the tokens that were sampled. A weight update during an episode shows
in its versions (a later turn, or a turn's later tokens, carry the newer version); the actor's staleness bound
counts the episode from its group's start, like any group.

Reward: the sum of the step rewards the environment gave (an outcome reward with done=True, optionally per-turn
ones, listed in meta["turn_rewards"]); the sample comes back with its label set, so the actor does not send it
to the reward service. An environment call that raises or runs past `env_timeout_s` ends the episode as failed
(reward 0, label `error`, meta["env_error"]); the episode's tokens so far are still a valid sample. An episode
that runs out of turns, tokens (`max_tokens`) or the server's context without `done` is `truncated` (reward 0,
finish_reason "length", so `algo.truncated: mask` leaves it out of the loss). An environment with a `close()`
method gets it called once when its episode ends, however it ended (bounded by the same timeout); one with an
async `open()` gets it awaited before reset, without the timeout (a wait for a free session of a server).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

from inflight.actor.rollout import RolloutClient, RolloutFn
from inflight.actor.server_pool import BadRequest
from inflight.actor.turns import TemplateError, TurnRenderer
from inflight.config.actor import ActorConfig
from inflight.contracts import Environment, Sample, StepResult, TaskSample
from inflight.tasks.tool_calls import tools_system_text

log = logging.getLogger(__name__)


@dataclass
class EpisodeConfig:
    max_turns: int = 4  # model turns per episode
    max_tokens: int = 0  # completion tokens per episode (model + environment); 0 = max_turns * max_new_tokens * 2
    env_timeout_s: float = 10.0  # per reset / step call

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tokens < 0 or not self.env_timeout_s > 0:
            raise ValueError("episodes need task.max_turns >= 1, task.max_episode_tokens >= 0, task.env_timeout_s > 0")


class EnvFailed(RuntimeError):
    """An environment call raised or timed out."""


def _in_daemon_thread(fn: Callable[..., Any], arg: Any) -> asyncio.Future:
    """fn(arg) on a thread of its own: not the loop's default executor, whose threads a hung tool would use up
    and which asyncio.run waits for at exit; a daemon thread is abandoned (a thread cannot be killed)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def run() -> None:
        try:
            res, exc = fn(arg), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            res, exc = None, e

        def settle() -> None:
            if not fut.done():
                fut.set_exception(exc) if exc is not None else fut.set_result(res)

        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is gone: nobody waits for this result any more
            pass

    threading.Thread(target=run, daemon=True, name="inflight-env").start()
    return fut


async def _call(fn: Callable[..., Any], arg: Any, timeout_s: float) -> Any:
    """fn(arg) bounded by timeout_s; a plain function runs on a thread of its own (a hung one cannot block the
    event loop; it is abandoned: run untrusted code in a subprocess, e.g. inflight.rewards.sandbox)."""
    try:
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(arg), timeout_s)
        res = await asyncio.wait_for(_in_daemon_thread(fn, arg), timeout_s)
        return await asyncio.wait_for(res, timeout_s) if inspect.isawaitable(res) else res
    except asyncio.TimeoutError:
        raise EnvFailed(f"{getattr(fn, '__qualname__', fn)} timed out after {timeout_s:g} s") from None
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise EnvFailed(f"{getattr(fn, '__qualname__', fn)} raised {type(exc).__name__}: {exc}") from exc


def _step_result(res: Any) -> StepResult:
    if isinstance(res, StepResult):
        return res
    if isinstance(res, tuple) and len(res) == 3:  # (messages, reward, done)
        return StepResult(list(res[0]), res[1], bool(res[2]))
    raise EnvFailed(f"step returned {type(res).__name__}; expected a StepResult or (messages, reward, done)")


def first_request(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  render: TurnRenderer) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The first turn's messages and extra request fields. An environment's tools go to the server where the chat
    template renders them (`tool_choice: none`: the reply comes back as the text the model wrote, calls included,
    for the environment to read); else they are described in a system message of ours."""
    if not tools:
        return messages, {}
    if render.renders_tools:
        return messages, {"tools": tools, "tool_choice": "none"}
    text = tools_system_text([t.get("function", t) for t in tools])
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]], {}
    return [{"role": "system", "content": text}, *messages], {}


async def run_episode(ts: TaskSample, env: Environment, client: RolloutClient, render: TurnRenderer,
                      ecfg: EpisodeConfig) -> Sample:
    per_turn = client.cfg.max_new_tokens
    budget = ecfg.max_tokens or 2 * ecfg.max_turns * per_turn
    ids: list[int] = []
    lps: list[float] = []
    vers: list[int] = []
    mask: list[int] = []
    rewards: list[float] = []
    info: dict[str, float] = {}
    meta: dict[str, Any] = {"turns": 0, "env_tokens": 0, "prefill_tokens": 0}
    prompt_ids: list[int] = []
    label, finish, reply = "truncated", "length", ""
    try:
        opener = getattr(env, "open", None)  # optional: waits for what the episode needs (a session), untimed
        if callable(opener) and inspect.isawaitable(opening := opener()):
            await opening
        messages = await _call(env.reset, ts, ecfg.env_timeout_s)
        messages, extra = first_request(list(messages), getattr(env, "tools", None), render)
        c = (await client.chat(messages, n=1, **extra))[0]
        prompt_ids = list(c.prompt_ids)
        while True:
            meta["turns"] += 1
            meta["prefill_tokens"] += len(c.prompt_ids)
            if c.prompt_ids != prompt_ids + ids:  # the server must continue from exactly what was sent
                raise RuntimeError("the server's prompt_token_ids differ from the episode's tokens")
            ids += c.token_ids
            lps += c.logprobs
            vers += c.versions
            mask += [1] * len(c.token_ids)
            reply, finish = c.text, c.finish_reason
            res = _step_result(await _call(env.step, reply, ecfg.env_timeout_s))
            for k, v in res.info.items():
                info[k] = info.get(k, 0.0) + float(v)
            if res.reward is not None:
                rewards.append(float(res.reward))
            if res.done:
                label = "correct" if sum(rewards) > 0 else "wrong"
                break
            if meta["turns"] >= ecfg.max_turns:
                break
            env_ids = render.delta(ids, res.messages)
            left = budget - len(ids) - len(env_ids)
            if left < 1:
                break
            ids += env_ids
            lps += [0.0] * len(env_ids)
            vers += [-1] * len(env_ids)
            mask += [0] * len(env_ids)
            meta["env_tokens"] += len(env_ids)
            try:
                c = (await client.complete(prompt_ids + ids, n=1, max_tokens=min(per_turn, left)))[0]
            except BadRequest as exc:  # the episode outgrew the server's context: it ends cut off
                if "context_length_exceeded" not in str(exc):
                    raise
                break
    except (EnvFailed, TemplateError) as exc:  # TemplateError: the environment's messages cannot be rendered
        log.warning("episode of %s failed: %s", ts.id, exc)
        label, rewards, meta["env_error"] = "error", [], str(exc)
        if not prompt_ids:  # reset failed: no tokens at all; the group fails (there is nothing to train)
            raise
    finally:
        close = getattr(env, "close", None)  # optional: not part of the Environment protocol
        if callable(close):  # the environment's own clean-up, however the episode ended
            try:
                await _call(lambda _: close(), None, ecfg.env_timeout_s)
            except EnvFailed as exc:
                log.warning("closing the environment of %s failed: %s", ts.id, exc)
    reward = sum(rewards) if label != "truncated" else 0.0
    meta.update(text=reply, turn_rewards=rewards, **info)
    return Sample(group_id=ts.id, prompt_ids=prompt_ids, completion_ids=ids, logprobs=lps, versions=vers,
                  reward=float(reward), label=label, finish_reason="length" if label == "truncated" else finish,
                  task_id=ts.id, meta=meta, loss_mask=mask)


def episode_rollout(make_env: Callable[[TaskSample], Environment], render: TurnRenderer,
                    ecfg: EpisodeConfig | None = None) -> RolloutFn:
    """A rollout (actor/rollout.py) that runs the group's G episodes concurrently, a fresh environment each."""
    ecfg = ecfg or EpisodeConfig()

    async def one(ts: TaskSample, client: RolloutClient) -> Sample:
        return await run_episode(ts, make_env(ts), client, render, ecfg)

    async def rollout(ts: TaskSample, client: RolloutClient, cfg: ActorConfig) -> list[Sample]:
        return list(await asyncio.gather(*(one(ts, client) for _ in range(cfg.group_size))))

    rollout.episode = one  # type: ignore[attr-defined]  # one episode: what held-out evaluation runs
    return rollout
