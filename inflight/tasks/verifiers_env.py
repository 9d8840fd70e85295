"""`verifiers`: environments written for the `verifiers` library run as inflight episodes, unchanged.

    task: {name: verifiers, env: <id of an installed environment | python module | path/to/env.py>, env_args: {...}}

verifiers (PyPI, Prime Intellect; its environment hub) ships environments as modules with
`load_environment(**kwargs) -> vf.Environment`: a dataset (rows: prompt messages or a question, answer, info), the
turn logic (`SingleTurnEnv`, `MultiTurnEnv.env_response`, `ToolEnv`'s tools) and a `Rubric` of reward functions.
Supported: the classic API, verifiers 0.1.x to 0.3.x (in 0.3 under `verifiers.legacy`, still `import verifiers as
vf`; tested with 0.3.1; 0.4 dropped it for a new stack).

inflight keeps the tokens; verifiers keeps the logic. The actor's episode loop (actor/episode.py) generates every
model turn (exact token ids, the environment's turns rendered once as a masked delta); this adapter replays what
verifiers' own `MultiTurnEnv.rollout` does around each model call, with the environment's own hooks:

    reset:  init_state(row) -> setup_state -> get_prompt_messages        the first prompt (+ tools, see below)
    step:   add_model_response(reply) -> is_completed (its @vf.stop conditions: max_turns, no tool called, ...)
            -> get_prompt_messages (calls env_response: tool results, a user turn) -> the new messages only
    done:   cleanup (renders state["completion"]) -> rubric.score_rollout -> reward, metrics

verifiers never sees or re-tokenises the model's tokens: it gets the reply text as an assistant message. Tools: a
ToolEnv's tools are the episode's `tools` (the chat template renders them, or the actor describes them in a system
message: actor/episode.py) and calls are read from the reply text in the Hermes format (tasks/tool_calls.py),
becoming the message's `tool_calls`; ToolEnv then runs them
and formats results and errors itself. Each episode runs the environment's coroutines on an event loop of its own
(a thread): a tool that blocks or hangs holds that episode only, never the actor; every call is bounded by
`task.env_timeout_s` and a failure ends that episode as `error` (actor/episode.py).

Not supported (refused with a clear error, or documented in docs/architecture.md): group reward functions
(rubrics scoring a group together), environments that call the model themselves (`state["client"]`), prompts that
are not a linear continuation (`get_prompt_messages` rewriting history), non-text content, `message_type:
completion`.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from inflight.config.tasks import TaskConfig
from inflight.contracts import StepResult, TaskSample, Verification
from inflight.tasks.math_jsonl import shuffled_forever
from inflight.tasks.one_turn import verify_one_turn
from inflight.tasks.tool_calls import parse_tool_calls


class VerifiersError(ValueError):
    """The environment cannot run here (what it needs is not supported)."""


@contextmanager
def _own_signals() -> Iterator[None]:
    """verifiers' Environment installs SIGINT/SIGTERM handlers when it is built (and signal.signal raises off the
    main thread): keep the process's own handlers, which decide how an inflight role stops."""
    if threading.current_thread() is threading.main_thread():
        saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in saved.items():
                signal.signal(s, h)
        return
    real = signal.signal
    signal.signal = lambda *a, **k: None
    try:
        yield
    finally:
        signal.signal = real


def load_vf_environment(env: str, env_args: dict[str, Any]) -> Any:
    """`vf.load_environment(env, **env_args)`; `env` may also be a .py file defining load_environment."""
    try:
        import verifiers as vf  # lazy: optional dependency (pip install 'inflight-rl[verifiers]')
    except ImportError as e:
        raise VerifiersError("task.name=verifiers needs the verifiers package: pip install 'inflight-rl[verifiers]'"
                             ) from e
    if not env:
        raise VerifiersError("task.name=verifiers: set task.env to an environment id, a module or a .py file")
    try:  # environments build their datasets at load: no progress bars in the actor's log
        from datasets.utils.logging import disable_progress_bar  # lazy: optional (comes with verifiers), ~2 s

        disable_progress_bar()
    except ImportError:
        pass
    with _own_signals():
        if env.endswith(".py"):
            path = Path(env).resolve()
            if not path.is_file():
                raise VerifiersError(f"task.env: no such file {env}")
            spec = importlib.util.spec_from_file_location(f"inflight_vf_env_{path.stem}", path)
            if spec is None or spec.loader is None:
                raise VerifiersError(f"task.env: {env} cannot be loaded as a Python module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            if not callable(getattr(module, "load_environment", None)):
                raise VerifiersError(f"task.env: {env} defines no load_environment()")
            return module.load_environment(**env_args)
        return vf.load_environment(env, **env_args)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        parts = [p.get("text") if isinstance(p, dict) else getattr(p, "text", None) for p in content]
        texts = [t for t in parts if isinstance(t, str)]
        if len(texts) == len(parts):
            return "".join(texts)
    raise VerifiersError(f"message content must be text, got {type(content).__name__}")


def _plain(m: Any, tool_role: str) -> dict[str, str]:
    """A verifiers message as the {role, content} the chat template renders."""
    role = m["role"] if isinstance(m, dict) else m.role
    if role not in ("system", "user", "assistant", "tool"):
        raise VerifiersError(f"message role {role!r} is not supported (chat messages only)")
    content = m.get("content") if isinstance(m, dict) else m.content
    return {"role": tool_role if role == "tool" else role, "content": _text(content or "")}


def _clean_row(row: dict[str, Any]) -> dict[str, Any]:
    """A dataset row as verifiers' rollout input: Arrow gives every message every key seen in the column (None
    where absent); drop those."""
    row = dict(row)
    if isinstance(row.get("prompt"), list):
        row["prompt"] = [{k: v for k, v in m.items() if v is not None} for m in row["prompt"]]
    return row


class VerifiersTask:
    """contracts.EnvTask over a verifiers environment: its dataset rows are the prompts, make_env an episode."""

    name = "verifiers"

    def __init__(self, cfg: TaskConfig, vf_env: Any = None):
        self.cfg = cfg
        self.env = vf_env if vf_env is not None else load_vf_environment(cfg.env, dict(cfg.env_args))
        if getattr(self.env, "message_type", "chat") != "chat":
            raise VerifiersError("verifiers environments with message_type='completion' are not supported")
        if self.env.rubric.has_group_rewards:
            raise VerifiersError("the environment's rubric has group reward functions (they score a group of "
                                 "rollouts together); inflight scores each episode alone: not supported")
        train = self._rows(self.env.get_dataset()) if self.env.dataset_source or self.env.dataset else []
        has_eval = self.env.eval_dataset_source is not None or self.env.eval_dataset is not None
        held = self._rows(self.env.get_eval_dataset()) if has_eval else []
        if not has_eval:  # hold out the last eval_size rows of the training set
            if len(train) <= cfg.eval_size:
                raise VerifiersError(f"the environment has no eval dataset and its {len(train)} rows are not more "
                                     f"than task.eval_size={cfg.eval_size}")
            train, held = train[:-cfg.eval_size], train[-cfg.eval_size:]
        if not train:
            raise VerifiersError("the environment has no training dataset")
        self._train = [self._sample("train", i, r) for i, r in enumerate(train)]
        self._eval = [self._sample("eval", i, r) for i, r in enumerate(held[:cfg.eval_size])]

    @staticmethod
    def _rows(ds: Any) -> list[dict[str, Any]]:
        return [_clean_row(r) for r in ds.to_list()]

    def _sample(self, split: str, i: int, row: dict[str, Any]) -> TaskSample:
        prompt = row.get("prompt")
        if not isinstance(prompt, list):
            raise VerifiersError(f"{split} row {i}: the prompt must be a list of chat messages")
        return TaskSample(id=f"vf-{split}-{row.get('example_id', i)}", messages=[_plain(m, self.cfg.tool_role)
                                                                                  for m in prompt],
                          answer=str(row.get("answer", "")), meta={"vf_row": row})

    def train_samples(self, seed: int) -> Iterator[TaskSample]:
        return shuffled_forever(self._train, f"vf-{self.cfg.seed}-{seed}")

    def eval_samples(self) -> list[TaskSample]:
        return list(self._eval)

    def make_env(self, sample: TaskSample) -> "VerifiersEpisode":
        return VerifiersEpisode(self, sample)

    def verify(self, completion: str, sample: TaskSample, finish_reason: str = "stop") -> Verification:
        """One reply scored as a whole episode's only turn (what a single-turn evaluation asks); an environment
        that wants another turn after it gives 0."""
        return verify_one_turn(self.make_env, sample, completion, finish_reason)


class VerifiersEpisode:
    """One episode (contracts.Environment) of a verifiers environment, on an event loop of its own."""

    def __init__(self, task: VerifiersTask, sample: TaskSample):
        self.task, self.env, self.sample = task, task.env, sample
        self.state: Any = None
        self.turn_prompt: list[Any] = []  # what verifiers sees as this turn's prompt (its message objects)
        self.tool_calls = 0
        self.tools: list[dict[str, Any]] | None = None  # the environment's tools, OpenAI's shape (after reset)
        self.done = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, daemon=True, name="inflight-vf-env")
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.loop.run_forever()
        finally:  # close() stopped it: free its selector and self-pipe now, not at garbage collection
            self.loop.close()

    async def _on_loop(self, coro: Any) -> Any:
        """Run `coro` on this episode's loop; a caller's timeout cancels it there."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def reset(self, sample: TaskSample) -> list[dict[str, str]]:
        return await self._on_loop(self._reset(sample))

    async def step(self, reply: str) -> StepResult:
        return await self._on_loop(self._step(reply))

    async def close(self) -> None:
        """The environment's cleanup handlers, also for an episode that ended without done (truncated, failed)."""
        try:
            if self.state is not None and not self.done:
                self.done = True
                await self._on_loop(self.env.cleanup(self.state))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)

    async def _reset(self, sample: TaskSample) -> list[dict[str, str]]:
        from verifiers.utils.message_utils import maybe_normalize_messages  # lazy: optional dependency (verifiers)

        env = self.env
        row = sample.meta["vf_row"]
        state = await env.init_state(row, _client(), "inflight", None)
        state = await env.setup_state(state) or state
        self.state = state
        if await env.is_completed(state):
            raise VerifiersError(f"the environment ended the episode before the first turn "
                                 f"({state.get('stop_condition')}: {state.get('error')!r})")
        self.turn_prompt = maybe_normalize_messages(await env.get_prompt_messages(state))
        role = self.task.cfg.tool_role
        messages = [_plain(m, role) for m in self.turn_prompt]
        tools = [t.model_dump() if hasattr(t, "model_dump") else dict(t) for t in state.get("tool_defs") or []]
        self.tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                        if t.get(k) is not None}} for t in tools] or None
        return messages

    async def _step(self, reply: str) -> StepResult:
        from verifiers.types import Response, ResponseMessage, ToolCall  # lazy: optional dependency (verifiers)
        from verifiers.utils.message_utils import maybe_normalize_messages  # lazy: optional dependency (verifiers)

        env, state = self.env, self.state
        calls = [ToolCall(id=f"call_{self.tool_calls + i}", name=n, arguments=a)
                 for i, (n, a) in enumerate(parse_tool_calls(reply) if state.get("tool_defs") else [])]
        self.tool_calls += len(calls)
        msg = ResponseMessage(content=reply, tool_calls=calls or None, finish_reason="tool_calls" if calls else "stop",
                              is_truncated=False)
        await env.add_model_response(state, self.turn_prompt, Response(
            id=f"inflight-{state['trajectory_id']}-{len(state['trajectory'])}", created=int(time.time()),
            model="inflight", message=msg))
        info = {"tool_calls": float(len(calls))}
        if await env.is_completed(state):
            return await self._finish(info)
        before = [*self.turn_prompt, *state["trajectory"][-1]["completion"]]
        prompt = maybe_normalize_messages(await env.get_prompt_messages(state))  # env_response runs here
        if state.get("final_env_response") is not None:  # the environment ended the episode in its response
            await env.is_completed(state)
            return await self._finish(info)
        if len(prompt) <= len(before) or any(_key(a) != _key(b) for a, b in zip(prompt, before, strict=False)):
            raise VerifiersError("the environment's next prompt does not continue the conversation (it rewrites "
                                 "earlier messages): not supported, the model's tokens would be re-rendered")
        self.turn_prompt = prompt
        role = self.task.cfg.tool_role
        return StepResult(messages=[_plain(m, role) for m in prompt[len(before):]], info=info)

    async def _finish(self, info: dict[str, float]) -> StepResult:
        env, state = self.env, self.state
        self.done = True
        await env.cleanup(state)  # renders state["completion"], runs the environment's cleanup handlers
        if env.score_rollouts:
            await env.rubric.score_rollout(state)
        else:
            await env.rubric.dummy_score_rollout(state)
        await env.rubric.cleanup(state)
        if state.get("error") is not None:
            raise VerifiersError(f"the environment's rollout failed: {state['error']!r}")
        for k, v in (state.get("metrics") or {}).items():
            if isinstance(v, (int, float)):
                info[f"vf_{k}"] = float(v)
        return StepResult(reward=float(state.get("reward") or 0.0), done=True, info=info)


def _key(m: Any) -> tuple[str, str]:
    return (m.role, repr(m.content))


@functools.cache
def _client() -> Any:
    """The state's model client (init_state wants a vf.Client): inflight generates every model turn, so an
    environment that calls the model itself fails its episode with this message."""
    import verifiers as vf  # lazy: optional dependency (verifiers)

    class NoModel(vf.Client):  # every abstract method
        def setup_client(self, config):  # noqa: ANN001
            return None

        async def to_native_tool(self, *a, **k):  # noqa: ANN002, ANN003
            raise VerifiersError("this verifiers environment calls the model itself (state['client']); inflight "
                                 "generates every model turn: not supported")

        to_native_prompt = get_native_response = raise_from_native_response = from_native_response = to_native_tool

        async def close(self) -> None:
            return None

    return NoModel(None)
