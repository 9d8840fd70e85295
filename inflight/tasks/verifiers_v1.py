"""`verifiers` 0.4 (its `verifiers.v1` stack): environments written for it run as inflight episodes, unchanged.

    task: {name: verifiers, env: <taskset id | module | path/to/taskset.py>, env_args: {<the [env] block>}}

Same config line as the classic API (tasks/verifiers_env.py); `tasks.get_task` picks this adapter when the installed
verifiers is 0.4 or later. A 0.4 environment is a taskset package (a module exporting a `vf.Taskset` subclass via
`__all__`, optionally an `Env` subclass for multi-turn or multi-agent logic and a `Harness` of its own): task.env is
its id (`env.taskset.id`), task.env_args the rest of verifiers' `[env]` config (`taskset.*`, `agent.*`, ...).

In 0.4 the environment calls the model: an agent's harness program (the `null`/`bash` chat loops, run by verifiers
in a runtime) sends OpenAI chat requests to verifiers' interception server, which hands each to a model `Client`.
inflight plugs in that client, so verifiers runs everything it owns (its Env.run, harness, MCP tool servers,
@vf.stop conditions, limits, scoring) while inflight generates every model turn with exact tokens:

    reset:  env.run_episode(task) starts on the adapter's event loop; its first model request -> the prompt
    step:   the reply text answers the pending request (tool calls read from it, Hermes format, tasks/tool_calls.py);
            the episode's next model request -> the messages it adds (a linear continuation, checked), or the
            episode ends -> the trace's reward (its @vf.reward functions, weighted) and metrics

The environment's own sampling settings (temperature, max_tokens) are not used: the actor's are. Agents run in
verifiers' `subprocess` runtime unless env_args names another; the chat-loop harnesses need `uv` (pip install uv;
it fetches their few packages once). Not supported (refused with a clear error): episodes with several agents
(each trace is one inflight episode), responses the environment rewrites (@vf.intercept), non-text content.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import importlib.util
import os
import shutil
import sys
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterator

from inflight.config.tasks import TaskConfig
from inflight.contracts import StepResult, TaskSample, Verification
from inflight.tasks.math_jsonl import shuffled_forever
from inflight.tasks.one_turn import verify_one_turn
from inflight.tasks.tool_calls import parse_tool_calls
from inflight.tasks.verifiers_env import VerifiersError, _own_signals, _plain

# the sentinel endpoint of inflight's model client: verifiers resolves a client per config, this one is ours
INFLIGHT_URL = "http://inflight.model.invalid/v1"


def verifiers_major_minor() -> tuple[int, int] | None:
    """(major, minor) of the installed verifiers, None when it is not installed."""
    try:
        parts = version("verifiers").split(".")
    except PackageNotFoundError:
        return None
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def is_v1_installed() -> bool:
    v = verifiers_major_minor()
    return v is not None and v >= (0, 4)


def _import_file(env: str) -> str:
    """A .py taskset file as an importable module (its folder on sys.path and on PYTHONPATH, which verifiers'
    tool servers, started as `python -m <module>`, need too); returns its module name."""
    path = Path(env).resolve()
    if not path.is_file():
        raise VerifiersError(f"task.env: no such file {env}")
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([folder, *paths])
    if importlib.util.find_spec(path.stem) is None:
        raise VerifiersError(f"task.env: {env} cannot be imported as module {path.stem!r}")
    return path.stem


def load_v1_environment(env: str, env_args: dict[str, Any]) -> Any:
    """verifiers' `load_environment(EnvConfig)`: task.env is the taskset id, env_args the rest of the [env] block.
    Agents without a runtime of their own run in the local `subprocess` runtime (0.4's default is a remote
    sandbox)."""
    import verifiers.v1 as vf  # lazy: verifiers 0.4 is optional
    from verifiers.v1.configs.agent import agent_config_fields  # lazy: verifiers 0.4 is optional
    from verifiers.v1.runtimes import SubprocessConfig  # lazy: verifiers 0.4 is optional

    if not env:
        raise VerifiersError("task.name=verifiers: set task.env to a taskset id, a module or a .py file")
    taskset_id = _import_file(env) if env.endswith(".py") else env
    args = dict(env_args)
    taskset = dict(args.pop("taskset", None) or {})
    if shutil.which("uv") is None and (Path(sys.executable).parent / "uv").exists():
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        cfg = vf.resolve_env_config({**args, "taskset": {**taskset, "id": taskset_id}})
    except (ImportError, AttributeError, TypeError, ValueError) as e:  # what verifiers raises for a bad [env]
        raise VerifiersError(f"task.env={env}: {e}") from e
    for name, spec in agent_config_fields(cfg).items():
        if "runtime" not in spec.model_fields_set:
            setattr(cfg, name, spec.model_copy(update={"runtime": SubprocessConfig()}))
    with _own_signals():
        return vf.load_environment(cfg)


def _prompt_messages(data: Any, tool_role: str) -> list[dict[str, str]]:
    """A task's opening messages as its data states them (what evaluation logs show; the episode's own first
    request is what the model answers)."""
    out = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        out.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        out.extend(_plain(m, tool_role) for m in data.prompt)
    return out


class VerifiersV1Task:
    """contracts.EnvTask over a verifiers 0.4 environment: its taskset's tasks are the prompts, make_env an
    episode (one `Env.run_episode`)."""

    name = "verifiers"

    def __init__(self, cfg: TaskConfig, vf_env: Any = None):
        self.cfg = cfg
        self.env = vf_env if vf_env is not None else load_v1_environment(cfg.env, dict(cfg.env_args))
        if not self.env.taskset.bounded:
            raise VerifiersError("the environment's taskset is infinite: bound it (env_args taskset.* or its "
                                 "own config) so inflight can hold out task.eval_size tasks")
        tasks = list(self.env.taskset)
        if len(tasks) <= cfg.eval_size:
            raise VerifiersError(f"the environment's taskset has {len(tasks)} tasks, not more than "
                                 f"task.eval_size={cfg.eval_size} (the last eval_size are held out)")
        self._train = [self._sample("train", t) for t in tasks[:-cfg.eval_size]]
        self._eval = [self._sample("eval", t) for t in tasks[-cfg.eval_size:]]
        self.runner = _Runner(self.env)

    def _sample(self, split: str, task: Any) -> TaskSample:
        d = task.data
        return TaskSample(id=f"vf-{split}-{d.id or d.idx}", messages=_prompt_messages(d, self.cfg.tool_role),
                          answer=str(getattr(d, "answer", "") or ""), meta={"vf_task": task})

    def train_samples(self, seed: int) -> Iterator[TaskSample]:
        return shuffled_forever(self._train, f"vf-{self.cfg.seed}-{seed}")

    def eval_samples(self) -> list[TaskSample]:
        return list(self._eval)

    def make_env(self, sample: TaskSample) -> "VerifiersV1Episode":
        return VerifiersV1Episode(self, sample)

    def verify(self, completion: str, sample: TaskSample, finish_reason: str = "stop") -> Verification:
        """One reply scored as a whole episode's only turn; an environment that wants another turn gives 0."""
        return verify_one_turn(self.make_env, sample, completion, finish_reason)


class _Runner:
    """The environment's event loop (a daemon thread) holding `env.serving()` (its interception server, shared
    tool servers) open for the task's lifetime; episodes run on it."""

    def __init__(self, env: Any):
        self.env = env
        self.loop = asyncio.new_event_loop()
        self.ready: asyncio.Future[None] | None = None
        self.serving: asyncio.Task[None] | None = None
        self.stop_serving = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="inflight-vf1-env")
        self.thread.start()
        atexit.register(self.close)

    def close(self, timeout_s: float = 15.0) -> None:
        """Leave `env.serving()` (stops its interception and tool servers) and the loop; at exit at the latest."""
        if not self.loop.is_running():
            return

        async def stop() -> None:
            episodes = [t for t in asyncio.all_tasks() if t not in (asyncio.current_task(), self.serving)]
            for t in episodes:
                t.cancel()
            await asyncio.gather(*episodes, return_exceptions=True)
            self.stop_serving.set()
            if self.serving is not None:
                await asyncio.gather(self.serving, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout_s)
        except Exception:  # noqa: BLE001 - shutting down: what did not stop in time dies with the process
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def _serve(self, started: asyncio.Future[None]) -> None:
        try:
            async with self.env.serving():
                started.set_result(None)
                await self.stop_serving.wait()  # until close()
        except BaseException as e:
            if not started.done():
                started.set_exception(e)
            raise

    async def _ensure(self) -> None:
        if self.ready is None:
            self.ready = self.loop.create_future()
            self.serving = self.loop.create_task(self._serve(self.ready))  # held: the loop keeps tasks weakly
        await self.ready

    def submit(self, coro: Any) -> Any:
        """Run `coro` on the environment's loop once it serves; a concurrent.futures.Future."""
        async def run() -> Any:
            try:
                await self._ensure()
            except BaseException:
                coro.close()  # never started: no "never awaited" warning
                raise
            return await coro

        return asyncio.run_coroutine_threadsafe(run(), self.loop)


class _Channel:
    """One episode's model requests and replies, on the environment's loop."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.reply: asyncio.Future[str] | None = None
        self.trace_id: str | None = None


_CHANNELS: dict[str, _Channel] = {}  # trace id -> the episode it belongs to (touched on environment loops only)


class VerifiersV1Episode:
    """One episode (contracts.Environment): verifiers runs it, inflight answers its model requests."""

    def __init__(self, task: VerifiersV1Task, sample: TaskSample):
        self.task, self.sample = task, sample
        self.runner = task.runner
        self.channel: _Channel | None = None
        self.running: asyncio.Task[None] | None = None  # verifiers' run_episode, on the environment's loop
        self.tools: list[dict[str, Any]] | None = None  # the environment's tools, OpenAI's shape (after reset)
        self.prompt: list[Any] = []  # the pending request's messages (verifiers' message objects)
        self.tool_calls = 0
        self.done = False

    async def _on_loop(self, coro: Any) -> Any:
        return await asyncio.wrap_future(self.runner.submit(coro))

    async def reset(self, sample: TaskSample) -> list[dict[str, str]]:
        return await self._on_loop(self._reset(sample))

    async def step(self, reply: str) -> StepResult:
        return await self._on_loop(self._step(reply))

    async def close(self) -> None:
        """An episode that ended without done (truncated, failed): stop verifiers' rollout (its harness program)."""
        if self.running is not None and not self.done:
            self.done = True
            await self._on_loop(self._cancel())

    async def _cancel(self) -> None:
        ch = self.channel
        if ch is not None and ch.reply is not None and not ch.reply.done():
            ch.reply.set_exception(VerifiersError("inflight ended the episode"))
        assert self.running is not None
        self.running.cancel()
        await asyncio.gather(self.running, return_exceptions=True)
        if ch is not None and ch.trace_id is not None:
            _CHANNELS.pop(ch.trace_id, None)

    async def _reset(self, sample: TaskSample) -> list[dict[str, str]]:
        import verifiers.v1 as vf  # lazy: verifiers 0.4 is optional

        _install_client()
        ch = self.channel = _Channel()

        def on_trace(trace: Any) -> None:
            if ch.trace_id is not None:
                raise VerifiersError("the environment ran a second agent in one episode (several traces): not "
                                     "supported, inflight trains one model conversation per episode")
            ch.trace_id = trace.id
            _CHANNELS[trace.id] = ch

        async def episode() -> None:
            try:
                result = await self.task.env.run_episode(sample.meta["vf_task"], ctx, on_trace=on_trace)
                ch.events.put_nowait(("done", result))
            except Exception as e:  # noqa: BLE001 - the episode's failure, reported by the step that waits for it
                ch.events.put_nowait(("error", e))
            finally:
                if ch.trace_id is not None:
                    _CHANNELS.pop(ch.trace_id, None)

        ctx = vf.ModelContext(model="inflight", client=vf.TrainClientConfig(base_url=INFLIGHT_URL,
                                                                           api_key_var="INFLIGHT_VF_UNUSED"))
        self.running = asyncio.get_running_loop().create_task(episode())
        kind, value = await ch.events.get()
        if kind != "request":
            raise VerifiersError(f"the environment ended the episode before the first model turn: {_why(value)}")
        self.prompt, tools = value
        role = self.task.cfg.tool_role
        messages = [_plain(m, role) for m in self.prompt]
        # the chat template renders them, or the actor describes them in a system message (actor/episode.py)
        self.tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                        "parameters": t.parameters}} for t in tools or []] or None
        return messages

    async def _step(self, reply: str) -> StepResult:
        ch = self.channel
        assert ch is not None and ch.reply is not None
        calls = parse_tool_calls(reply) if self.tools else []
        if not ch.reply.done():  # else the request was abandoned (the harness died): its end is in the events
            ch.reply.set_result(reply)
        self.tool_calls += len(calls)
        info = {"tool_calls": float(len(calls))}
        kind, value = await ch.events.get()
        if kind == "request":
            prompt, _ = value
            before = self.prompt
            n = len(before)
            if len(prompt) <= n + 1 or any(_key(a) != _key(b) for a, b in zip(prompt[:n], before, strict=True)) \
                    or prompt[n].role != "assistant" or _text_of(prompt[n]) != reply:
                raise VerifiersError("the environment's next model request does not continue the conversation "
                                     "(it rewrites earlier messages or the reply): not supported, the model's "
                                     "tokens would be re-rendered")
            self.prompt = prompt
            role = self.task.cfg.tool_role
            return StepResult(messages=[_plain(m, role) for m in prompt[n + 1:]], info=info)
        self.done = True
        if kind == "error":
            raise VerifiersError(f"the environment's episode failed: {_why(value)}")
        return self._finish(value, info)

    @staticmethod
    def _finish(episode: Any, info: dict[str, float]) -> StepResult:
        if not episode.ok or len(episode.traces) != 1:
            raise VerifiersError(f"the environment's episode failed: {_why(episode)}")
        trace = episode.traces[0]
        for name, r in trace.rewards.items():
            if r is not None:
                info[f"vf_{name}"] = float(r.score)
        for name, v in trace.metrics.items():
            if isinstance(v, (int, float)):
                info[f"vf_{name}"] = float(v)
        return StepResult(reward=float(trace.reward), done=True, info=info)


def _text_of(m: Any) -> str:
    return _plain(m, "tool")["content"]


def _key(m: Any) -> tuple[str, str]:
    return (m.role, repr(m.content))


def _why(value: Any) -> str:
    """What ended an episode: an exception, or a finished episode's errors."""
    if isinstance(value, BaseException):
        return f"{type(value).__name__}: {value}"
    errors = [*getattr(value, "errors", [])] + [e for t in getattr(value, "traces", []) for e in t.errors]
    if errors:
        return "; ".join(f"{e.type}: {e.message[-600:]}" for e in errors)
    return f"{len(getattr(value, 'traces', []))} traces, stop {[t.stop_condition for t in value.traces]}"


class _InflightClient:
    """verifiers' model Client for the sentinel endpoint: each request goes to the inflight episode that owns
    the rollout (by its trace id) and waits for the reply inflight generated."""

    async def get_response(self, dialect: Any, body: dict, sampling: Any, session_id: str | None = None,
                           turn: Any = None, headers: Any = None) -> Any:
        from verifiers.v1.clients.train import serialize_completion  # lazy: verifiers 0.4 is optional
        from verifiers.v1.dialects import ChatDialect  # lazy: verifiers 0.4 is optional
        from verifiers.v1.types import AssistantMessage, Response, ToolCall  # lazy: verifiers 0.4 is optional

        if not isinstance(dialect, ChatDialect):
            raise VerifiersError(f"the harness speaks {type(dialect).__name__}: inflight serves chat completions")
        ch = _CHANNELS.get(session_id or "")
        if ch is None:
            raise VerifiersError(f"a model request from rollout {session_id!r}, which no inflight episode owns")
        request = dialect.parse_request(body)
        ch.reply = asyncio.get_running_loop().create_future()
        ch.events.put_nowait(("request", (request.messages, request.tools)))
        text = await ch.reply
        calls = [ToolCall(id=f"call_{i}", name=n, arguments=a)
                 for i, (n, a) in enumerate(parse_tool_calls(text) if request.tools else [])]
        response = Response(id=f"inflight-{session_id}-{time.monotonic_ns()}", created=int(time.time()),
                            model=body.get("model", "inflight"),
                            message=AssistantMessage(content=text, tool_calls=calls or None),
                            finish_reason="tool_calls" if calls else "stop")
        response.raw = serialize_completion(response, response.model)
        return response

    async def close(self) -> None:
        return None


@functools.cache
def _install_client() -> None:
    """verifiers' interception server builds its clients with `resolve_client(config)`: the sentinel config
    resolves to inflight's client, every other one (a judge's endpoint) as before."""
    from verifiers.v1.clients import Client  # lazy: verifiers 0.4 is optional
    from verifiers.v1.interception import server  # lazy: verifiers 0.4 is optional

    client_cls = type("InflightClient", (_InflightClient, Client), {})
    original = server.resolve_client

    def resolve(config: Any) -> Any:
        return client_cls() if config.base_url == INFLIGHT_URL else original(config)

    server.resolve_client = resolve
