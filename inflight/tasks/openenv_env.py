"""`openenv`: episodes against an OpenEnv environment server (PyPI `openenv-core`), one WebSocket session each.

    task: {name: openenv, env: http://127.0.0.1:8001,
           env_args: {renderer: my_pkg.agent:render, action_parser: my_pkg.agent:parse, reward: sum}}

An OpenEnv server (`openenv.core.env_server.create_app` / `create_fastapi_app` around an `Environment` class) runs
`reset` / `step` on typed actions and observations (pydantic models, JSON on the wire). Its HTTP routes build a
fresh environment per request, so an episode of several steps uses the `/ws` session protocol, through openenv's
own `GenericEnvClient` (dict actions and observations: no environment package needed on this side):

    reset:  a session (client.connect), client.reset(seed=..., **reset_args) -> renderer(observation, "reset")
            -> the first prompt
    step:   action_parser(reply text) -> client.step(action) -> reward, done, renderer(observation, "step") -> the
            messages after the reply (a user turn with the environment's feedback), rendered once and masked
    close:  client.close() (the server drops the session and its environment)

The actor's episode loop (actor/episode.py) generates every model turn with exact tokens. The reward is the sum of
the step rewards the observations carry (`reward: sum`) or the reward of the last one (`reward: final`).

Prompts: an OpenEnv environment has no dataset; `reset(seed=...)` picks the problem. Held-out episodes reset with
seeds 0 .. eval_size-1, training ones with seeds drawn from [eval_size, 2**31) (the group's G episodes share one).
Sessions: a server allows `max_concurrent_envs` sessions at once (1 unless its app says more); `max_sessions`
bounds this actor's open sessions, episodes wait for a free one (Environment.open, untimed) instead of being
refused by the server.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import random
from typing import Any, Callable, Iterator

import httpx

from inflight.config.tasks import TaskConfig
from inflight.contracts import StepResult, TaskSample, Verification
from inflight.tasks.one_turn import verify_one_turn

ARGS = {"renderer", "action_parser", "reward", "reset_args", "max_sessions"}
REWARDS = ("sum", "final")
SEED_SPACE = 2**31


class OpenEnvError(ValueError):
    """The OpenEnv task cannot run with these settings (bad env_args, no server)."""


def _client_class() -> tuple[Any, type[BaseException]]:
    """openenv's GenericEnvClient, and the error its websockets connection raises when the server closed it."""
    try:
        from openenv.core.generic_client import GenericEnvClient  # lazy: openenv-core is optional (gradio, fastmcp)
        from websockets.exceptions import ConnectionClosed  # lazy: comes with openenv-core
    except ImportError as e:
        raise OpenEnvError("task.name=openenv needs openenv-core in this environment: pip install openenv-core"
                           ) from e
    return GenericEnvClient, ConnectionClosed


def load_callable(spec: Any, key: str) -> Callable[..., Any]:
    """`package.module:name` or `package.module.name` -> the object, which must be callable."""
    if not isinstance(spec, str) or not spec.strip():
        raise OpenEnvError(f"task.env_args.{key}: name a function as 'package.module:function', got {spec!r}")
    mod_name, sep, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not sep or not mod_name or not attr:
        raise OpenEnvError(f"task.env_args.{key}={spec!r}: name a function as 'package.module:function'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise OpenEnvError(f"task.env_args.{key}={spec!r}: cannot import {mod_name}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise OpenEnvError(f"task.env_args.{key}={spec!r}: {mod_name} has no function {attr!r}")
    return fn


def _takes_context(fn: Callable[..., Any]) -> bool:
    """Whether the renderer takes the context ('reset' | 'step') after the observation."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def check_server(url: str, timeout_s: float) -> None:
    """GET /health: the server is up and an OpenEnv server (a clear error at start, not one per episode)."""
    base = url.rstrip("/").replace("ws://", "http://", 1).replace("wss://", "https://", 1)
    try:
        r = httpx.get(f"{base}/health", timeout=timeout_s, trust_env=False)
    except httpx.HTTPError as e:
        raise OpenEnvError(f"task.env: no OpenEnv server answers at {url} (GET /health: {type(e).__name__}: {e}); "
                           "start it first") from e
    if r.status_code != 200:
        raise OpenEnvError(f"task.env: {url} answers GET /health with HTTP {r.status_code}: not an OpenEnv server?")


class OpenEnvTask:
    """contracts.EnvTask over an OpenEnv server: each sample is a reset seed, make_env one session."""

    name = "openenv"

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        args = dict(cfg.env_args)
        unknown = sorted(set(args) - ARGS)
        if unknown:
            raise OpenEnvError(f"task.env_args: unknown key(s) {unknown} for task.name=openenv; known: {sorted(ARGS)}")
        if not cfg.env:
            raise OpenEnvError("task.name=openenv: set task.env to the OpenEnv server's URL, e.g. http://127.0.0.1:8000")
        self.reward_mode = args.get("reward", "sum")
        if self.reward_mode not in REWARDS:
            raise OpenEnvError(f"task.env_args.reward={self.reward_mode!r}: choose one of {list(REWARDS)}")
        reset_args = args.get("reset_args") or {}
        if not hasattr(reset_args, "keys"):
            raise OpenEnvError(f"task.env_args.reset_args must be a mapping of reset's keyword arguments, got "
                               f"{reset_args!r}")
        self.reset_args = dict(reset_args)
        if "seed" in self.reset_args:
            raise OpenEnvError("task.env_args.reset_args: 'seed' is set per episode (held-out: 0 .. eval_size-1)")
        self.max_sessions = args.get("max_sessions", 1)
        if not isinstance(self.max_sessions, int) or self.max_sessions < 0:
            raise OpenEnvError(f"task.env_args.max_sessions must be an integer >= 0 (0 = no limit), got "
                               f"{self.max_sessions!r}")
        for key in ("renderer", "action_parser"):
            if key not in args:
                raise OpenEnvError(f"task.name=openenv needs task.env_args.{key} ('package.module:function')")
        self.render = load_callable(args["renderer"], "renderer")
        self.render_context = _takes_context(self.render)
        self.parse = load_callable(args["action_parser"], "action_parser")
        self.client_cls, self.closed_error = _client_class()
        if cfg.eval_size < 0 or cfg.eval_size >= SEED_SPACE:
            raise OpenEnvError(f"task.eval_size must be in [0, {SEED_SPACE})")
        check_server(cfg.env, cfg.env_timeout_s)
        self._slots: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def slot(self) -> asyncio.Semaphore | None:
        """This event loop's session limit (a semaphore belongs to one loop)."""
        if not self.max_sessions:
            return None
        loop = asyncio.get_running_loop()
        if loop not in self._slots:
            self._slots = {lp: s for lp, s in self._slots.items() if not lp.is_closed()}
            self._slots[loop] = asyncio.Semaphore(self.max_sessions)
        return self._slots[loop]

    def _sample(self, split: str, seed: int) -> TaskSample:
        return TaskSample(id=f"openenv-{split}-{seed}", answer="", meta={"seed": seed},
                          messages=[{"role": "user", "content": f"(OpenEnv episode, seed {seed})"}])

    def train_samples(self, seed: int) -> Iterator[TaskSample]:
        rng = random.Random(f"openenv-{self.cfg.seed}-{seed}")
        while True:
            yield self._sample("train", rng.randrange(self.cfg.eval_size, SEED_SPACE))

    def eval_samples(self) -> list[TaskSample]:
        return [self._sample("eval", s) for s in range(self.cfg.eval_size)]

    def make_env(self, sample: TaskSample) -> "OpenEnvEpisode":
        return OpenEnvEpisode(self)

    def verify(self, completion: str, sample: TaskSample, finish_reason: str = "stop") -> Verification:
        """One reply scored as a whole episode's only step (a single-turn evaluation); no done after it gives 0."""
        return verify_one_turn(self.make_env, sample, completion, finish_reason)


class OpenEnvEpisode:
    """One episode (contracts.Environment): one WebSocket session of the server, opened at reset."""

    def __init__(self, task: OpenEnvTask):
        self.task = task
        timeout = task.cfg.env_timeout_s
        self.client = task.client_cls(base_url=task.cfg.env, connect_timeout_s=timeout, message_timeout_s=timeout)
        self.slot: asyncio.Semaphore | None = None

    async def open(self) -> None:
        """Wait for a free session (task.env_args.max_sessions); untimed, called before reset."""
        slot = self.task.slot()
        if slot is not None:
            await slot.acquire()
            self.slot = slot

    def _messages(self, observation: Any, context: str) -> list[dict[str, str]]:
        t = self.task
        out = t.render(observation, context) if t.render_context else t.render(observation)
        if not isinstance(out, list) or not all(isinstance(m, dict) for m in out):
            raise OpenEnvError(f"the renderer returned {type(out).__name__}; expected a list of chat messages")
        if context == "reset" and not out:
            raise OpenEnvError("the renderer returned no messages for the first observation (the first prompt)")
        return out

    async def reset(self, sample: TaskSample) -> list[dict[str, str]]:
        await self.client.connect()
        try:
            res = await self.client.reset(seed=sample.meta["seed"], **self.task.reset_args)
        except (RuntimeError, self.task.closed_error) as e:
            # a server at capacity answers a new session with an error (the client's "Server error: ... (code:
            # CAPACITY_REACHED)") and closes it, which the client may see first
            if isinstance(e, RuntimeError) and "CAPACITY_REACHED" not in str(e):
                raise
            raise OpenEnvError(f"the server refused the session ({type(e).__name__}: {e}): it allows fewer sessions at "
                               f"once than task.env_args.max_sessions={self.task.max_sessions} (0: no limit); set "
                               "it to the server's max_concurrent_envs at most") from e
        if res.done:
            raise OpenEnvError("the environment ended the episode at reset, before the first turn")
        return self._messages(res.observation, "reset")

    async def step(self, reply: str) -> StepResult:
        action = self.task.parse(reply)
        res = await self.client.step(action)
        reward = None if res.reward is None else float(res.reward)
        if self.task.reward_mode == "final":  # only the last observation's reward counts
            reward = (reward or 0.0) if res.done else None
        done = bool(res.done)
        return StepResult(messages=[] if done else self._messages(res.observation, "step"), reward=reward, done=done,
                          info={"env_steps": 1.0})

    async def close(self) -> None:
        try:
            await self.client.close()
        finally:
            if self.slot is not None:
                self.slot.release()
                self.slot = None
