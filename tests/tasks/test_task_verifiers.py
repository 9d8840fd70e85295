"""task.name=verifiers without a server: real verifiers environments (tests/tasks/vf_envs/tiny_envs.py, written
against the library's classic API) driven by scripted replies through the adapter. The live tests with the model's
exact tokens are in tests/actor/test_verifiers_live.py."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import pytest
import verifiers as vf
from datasets import Dataset

from inflight.tasks import TaskConfig, get_task
from inflight.tasks.tool_calls import parse_tool_calls
from inflight.tasks.verifiers_env import VerifiersError, VerifiersTask
from tests.signals import handlers, kept_signal_handlers

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")  # some tests build environments directly

ENVS = str(Path(__file__).parent / "vf_envs" / "tiny_envs.py")


def task(kind: str, **kw) -> VerifiersTask:
    return get_task(TaskConfig(name="verifiers", env=ENVS, env_args={"kind": kind}, **{"eval_size": 4, **kw}))


def call(expr: str) -> str:
    return f'Let me compute.<tool_call>\n{{"name": "calc", "arguments": {{"expr": "{expr}"}}}}\n</tool_call>'


def run(ep, replies: list[str], ts):
    async def main():
        out = [await ep.reset(ts)]
        try:
            for r in replies:
                out.append(await ep.step(r))
        finally:
            await ep.close()
        return out

    return asyncio.run(main())


@pytest.fixture(scope="module")
def tool_task():
    return task("tool")


def test_tool_env_episode_tools_and_rubric(tool_task):
    ts = tool_task.eval_samples()[0]
    expr = ts.messages[-1]["content"].split()[2].rstrip("?")  # "What is 69*33? ..."
    a, b = map(int, expr.split("*"))
    assert ts.answer == str(a * b) and ts.id == "vf-eval-0"
    ep = tool_task.make_env(ts)
    first, r1, r2 = run(ep, [call(expr), f"So \\boxed{{{a * b}}}"], ts)
    # the prompt: the env's own messages; its tools go with them (actor/episode.py: to the server, where the chat
    # template renders tools, else into the system message)
    assert first == ts.messages and first[0] == {"role": "system", "content": "Use the calculator."}
    assert [t["type"] for t in ep.tools] == ["function"] and ep.tools[0]["function"]["name"] == "calc"
    assert ep.tools[0]["function"]["parameters"]["properties"].keys() == {"expr"}
    # ToolEnv ran the tool on the call read from the reply text, and answered with a tool turn
    assert r1.messages == [{"role": "tool", "content": str(a * b)}] and not r1.done and r1.info["tool_calls"] == 1
    # the rubric: boxed_answer (weight 1) + used_tool (weight 0.5), computed here directly
    assert r2.done and r2.reward == 1.0 * 1.0 + 0.5 * 1.0
    assert r2.info["vf_boxed_answer"] == 1.0 and r2.info["vf_used_tool"] == 1.0 and r2.info["vf_calc_calls"] == 1.0


def test_tool_env_no_tool_call_ends_and_errors_are_the_envs(tool_task):
    ts = tool_task.eval_samples()[1]
    _, r = run(tool_task.make_env(ts), ["\\boxed{7}"], ts)
    assert r.done and r.reward == 0.0  # ToolEnv stops when a reply calls no tool; wrong answer, no tool
    # a malformed call and a failing tool: ToolEnv formats the errors itself (its error_formatter: str(e))
    _, r1, r2 = run(tool_task.make_env(ts), ["<tool_call>{not json</tool_call>", call("2**3")], ts)
    assert r1.messages[0]["role"] == "tool" and "Expecting property name" in r1.messages[0]["content"]
    assert r2.messages == [{"role": "tool", "content": "unsupported expression: '2**3'"}]


def test_parse_tool_calls():
    assert parse_tool_calls('a<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>b'
                            '<tool_call> {"name": "g", "arguments": "{}"}') == [("f", '{"x": 1}'), ("g", "{}")]
    assert parse_tool_calls("<tool_call>[1]</tool_call>") == [("invalid", "[1]")]
    assert parse_tool_calls("no call") == []


def test_single_turn_env_split_and_verify():
    t = task("single")  # 16 rows, no eval dataset: the last 4 are held out
    assert [s.id for s in t.eval_samples()] == [f"vf-eval-{i}" for i in range(12, 16)]  # ids keep example_id
    train = [s for s, _ in zip(t.train_samples(0), range(12))]
    assert sorted(s.id for s in train) == sorted(f"vf-train-{i}" for i in range(12))  # one pass: each row once
    assert {s.messages[-1]["content"] for s in train}.isdisjoint({s.messages[-1]["content"] for s in t.eval_samples()})
    s = t.eval_samples()[0]
    assert t.verify(f"\\boxed{{{s.answer}}}", s).reward == 1.0  # the rubric's async reward function
    assert t.verify("\\boxed{-1}", s).reward == 0.0


def test_multi_turn_env_user_turns_until_max_turns():
    t = task("retry")
    ts = t.eval_samples()[0]
    _, r1, r2, r3 = run(t.make_env(ts), ["12", "ab", "3c"], ts)
    assert r1.messages == r2.messages == [{"role": "user", "content": "Try again."}]
    assert not r1.done and not r2.done and r3.done  # max_turns=3: the env's own stop condition
    assert r3.reward == pytest.approx(3 / 6) and r3.info["vf_num_turns"] == 3.0


def test_unsupported_environments_are_refused():
    ds = Dataset.from_list([{"question": "q", "answer": "a"}] * 8)

    def group_reward(completions, answers) -> list[float]:
        return [0.0] * len(completions)

    with pytest.raises(VerifiersError, match="group reward"):
        VerifiersTask(TaskConfig(name="verifiers", eval_size=2), vf.SingleTurnEnv(
            dataset=ds, rubric=vf.Rubric(funcs=[group_reward])))

    class Rewrites(vf.MultiTurnEnv):  # a prompt that is not a continuation: refused, never re-rendered
        async def env_response(self, messages, state, **kwargs):
            return [{"role": "user", "content": "again"}]

        async def get_prompt_messages(self, state):
            if not state["trajectory"]:
                return state["prompt"]
            await self.env_response([], state)
            return [vf.UserMessage(content="a new conversation")]

    t = VerifiersTask(TaskConfig(name="verifiers", eval_size=2), Rewrites(dataset=ds, max_turns=3))
    ts = t.eval_samples()[0]
    with pytest.raises(VerifiersError, match="does not continue"):
        run(t.make_env(ts), ["x"], ts)
    with pytest.raises(VerifiersError, match="set task.env"):
        get_task(TaskConfig(name="verifiers"))


def test_hanging_tool_holds_its_episode_only():
    """A tool that blocks (a plain function, which ToolEnv calls on the event loop) runs on the episode's own loop:
    the caller's loop keeps running and its timeout ends the call."""
    def slow(x: str) -> str:
        """Sleeps.

        Args:
            x: anything
        """
        time.sleep(3)
        return x

    t = VerifiersTask(TaskConfig(name="verifiers", eval_size=1), vf.ToolEnv(
        dataset=Dataset.from_list([{"question": "q", "answer": "a"}] * 4), tools=[slow]))
    ts = t.eval_samples()[0]

    async def main():
        ep = t.make_env(ts)
        await ep.reset(ts)
        ticks = []

        async def tick():
            while True:
                await asyncio.sleep(0.01)
                ticks.append(time.monotonic())

        ticker = asyncio.create_task(tick())
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ep.step('<tool_call>{"name": "slow", "arguments": {"x": "1"}}</tool_call>'), 0.5)
        t1 = time.monotonic()
        ticker.cancel()
        return t1 - t0, [b - a for a, b in zip([t0, *ticks], [*ticks, t1], strict=True)]

    took, gaps = asyncio.run(main())
    # the loop ticked all along: no gap near the tool's 3 s (a busy core delays a tick's wake-up by ms, not seconds)
    assert took < 1.5 and len(gaps) > 5 and max(gaps) < 0.3, (took, len(gaps), max(gaps))


def _mine(signum, frame) -> None:  # a handler of this process's own
    raise AssertionError("never called")


def test_loading_keeps_the_process_signal_handlers():
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _mine)  # undone by keep_signal_handlers
    mine = handlers()
    task("single")
    assert handlers() == mine == {signal.SIGINT: _mine, signal.SIGTERM: _mine}
    # loaded off the main thread (where signal.signal raises): no error, nothing changed, signal.signal restored
    real, errors = signal.signal, []
    th = threading.Thread(target=lambda: errors.extend(_load_or_error("retry")))
    th.start()
    th.join()
    assert errors == [] and handlers() == mine and signal.signal is real


def _load_or_error(kind: str) -> list[BaseException]:
    try:
        task(kind)
    except BaseException as e:  # noqa: BLE001 - reported to the main thread
        return [e]
    return []


def test_an_environment_built_directly_replaces_the_handlers_until_restored():
    """What keep_signal_handlers guards against: building a verifiers environment (not through the loader)
    installs the library's handlers in this process; kept_signal_handlers puts the previous ones back."""
    before = handlers()
    with kept_signal_handlers():
        vf.SingleTurnEnv(dataset=Dataset.from_list([{"question": "q", "answer": "a"}] * 2),
                         rubric=vf.Rubric(funcs=[]))
        inside = handlers()
        assert all(inside[s] is not before[s] for s in inside), inside  # the library's own, for both
    assert handlers() == before
