"""Rollouts: the user's extension point.

A rollout turns one prompt into the samples of one group:

    async def rollout(task_sample: TaskSample, client: RolloutClient, cfg: ActorConfig) -> list[Sample]

The actor then scores the samples (reward service), gives them a group id and sends the group to the trainer. The
rule a rollout must keep: token ids, behaviour logprobs and versions are taken exactly as the server returned them
(never re-tokenise text), and `Sample.meta["text"]` holds the text the verifier should read. A sample that comes
back with its `label` set was scored by the rollout itself (an episode's environment) and skips the reward service.

Multi-turn tasks (tools, user turns) do not write a rollout: they give an `Environment` (contracts.py) per
episode, and actor/episode.py runs it as one Sample per episode, the model's tokens exactly as sampled and the
environment's turns rendered once and masked out of the loss. A rollout that drives turns itself keeps the same
rule: continue with `client.complete(prompt_ids + episode_ids)` (token ids, POST /v1/completions), never by
re-sending the conversation as chat messages, which re-renders what the model wrote:

    async def two_turn_rollout(ts, client, cfg):
        first = (await client.chat(ts.messages, n=1))[0]
        tool = render.delta(first.token_ids, [{"role": "tool", "content": calculator(first.text)}])  # TurnRenderer
        second = (await client.complete(first.prompt_ids + first.token_ids + tool, n=1))[0]
        ...  # one Sample: completion = first.token_ids + tool + second.token_ids, loss_mask 1.. 0.. 1..
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from inflight import backends
from inflight.actor.response_parsers import Completion, ResponseError
from inflight.actor.server_pool import ServerPool
from inflight.config.actor import ActorConfig
from inflight.contracts import Sample, TaskSample


class RolloutClient:
    """What a rollout sees of the inference servers: chat requests with the run's sampling settings. The actor
    gives each group its own client (`for_group`) carrying the oldest weight version the group's tokens may come
    from; built-in servers hold a request until they have it (`min_weight_version`)."""

    def __init__(self, pool: ServerPool, cfg: ActorConfig, model: str | None = None, min_version: int = 0,
                 served: Callable[[int], str | None] | None = None, version: int | Callable[[], int] | None = None):
        self.pool = pool
        self.cfg = cfg
        self.model = model  # None: the name the servers report, looked up on the first request
        self.min_version = min_version
        # stock vLLM serving a LoRA run (trainer.protocol=vllm): `served(v)` is the adapter name of version v (None:
        # the base model), `version` the version this client's requests run under (a callable: the newest at each
        # request); every token of a response then has that version, confirmed by the response's "model"
        self.served = served
        self.version = version

    def for_group(self, min_version: int, version: int | None = None) -> "RolloutClient":
        return RolloutClient(self.pool, self.cfg, self.model, min_version, self.served, version)

    def served_as(self) -> tuple[str | None, int | None]:
        """(model name to ask for, the version its tokens have, or None when the server reports versions)."""
        if self.served is None or self.version is None:
            return self.model, None
        v = max(0, self.version() if callable(self.version) else self.version)
        return self.served(v) or self.model, v

    def _payload(self, model: str | None, n: int, max_tokens: int | None, temperature: float | None,
                 top_p: float | None, extra: dict[str, Any]) -> dict[str, Any]:
        payload = {
            "model": model,
            "n": n,
            "max_tokens": self.cfg.max_new_tokens if max_tokens is None else max_tokens,
            "temperature": self.cfg.temperature if temperature is None else temperature,
            "top_p": self.cfg.top_p if top_p is None else top_p,
            **extra,
        }
        if self.cfg.adapter != backends.BUILTIN:  # stock vLLM / SGLang return token ids only when asked
            payload.setdefault("return_token_ids", True)
        elif self.min_version > 0:
            payload["min_weight_version"] = self.min_version
        return payload

    @staticmethod
    def _stamp(completions: list[Completion], model: str | None, version: int | None) -> list[Completion]:
        """Every token of a response served under a versioned name has that version (vLLM keeps a running request
        on the adapter it started with)."""
        if version is None:
            return completions
        for c in completions:
            if c.model and c.model != model:
                raise ResponseError(f"asked for {model!r}, the server answered as {c.model!r}")
            c.versions = [version] * len(c.token_ids)
        return completions

    async def chat(
        self,
        messages: list[dict[str, str]],
        *,
        n: int = 1,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        **extra: Any,
    ) -> list[Completion]:
        if self.model is None:
            self.model = await self.pool.model_name()
        model, version = self.served_as()
        payload = self._payload(model, n, max_tokens, temperature, top_p, extra)
        payload.update(messages=messages, logprobs=True)
        return self._check_n(self._stamp(await self.pool.chat(payload), model, version), n)

    async def complete(
        self,
        prompt_ids: list[int],
        *,
        n: int = 1,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        **extra: Any,
    ) -> list[Completion]:
        """Continue from token ids (POST /v1/completions with `prompt` a list of ids): the server reads them as
        given, so a multi-turn episode is never re-tokenised. `prompt_ids` of each Completion echo them."""
        if self.model is None:
            self.model = await self.pool.model_name()
        model, version = self.served_as()
        payload = self._payload(model, n, max_tokens, temperature, top_p, extra)
        payload.update(prompt=list(prompt_ids), logprobs=0)
        return self._check_n(self._stamp(await self.pool.complete(payload), model, version), n)

    @staticmethod
    def _check_n(completions: list[Completion], n: int) -> list[Completion]:
        if len(completions) != n:
            raise RuntimeError(f"asked for n={n} choices, the server returned {len(completions)}")
        return completions

    @staticmethod
    def to_sample(ts: TaskSample, c: Completion, text: str | None = None) -> Sample:
        """A Sample holding the completion's tokens exactly as returned."""
        return Sample(
            group_id=ts.id,  # the actor replaces it with a unique group id
            prompt_ids=list(c.prompt_ids),
            completion_ids=list(c.token_ids),
            logprobs=list(c.logprobs),
            versions=list(c.versions),
            finish_reason=c.finish_reason,
            task_id=ts.id,
            meta={"text": c.text if text is None else text},
        )


RolloutFn = Callable[[TaskSample, RolloutClient, ActorConfig], Awaitable[list[Sample]]]


async def default_rollout(ts: TaskSample, client: RolloutClient, cfg: ActorConfig) -> list[Sample]:
    """Single turn: G samples of one prompt, as one request with n=G (cfg.use_n) or G requests with n=1."""
    G = cfg.group_size
    if cfg.use_n:
        completions = await client.chat(ts.messages, n=G)
    else:
        parts = await asyncio.gather(*(client.chat(ts.messages, n=1) for _ in range(G)))
        completions = [c for p in parts for c in p]
    return [client.to_sample(ts, c) for c in completions]
