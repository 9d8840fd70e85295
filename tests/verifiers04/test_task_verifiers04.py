"""task.name=verifiers with verifiers 0.4 installed, without a model server: environments written for 0.4's API
(tests/tasks/vf04_envs) run by verifiers itself (its harness program, MCP tool server, Env.run, scoring) while
scripted replies stand in for the model. The live tests with SmolLM2's exact tokens are in test_verifiers04_live.py."""

from __future__ import annotations

import asyncio

import pytest

from inflight.tasks import get_task
from inflight.tasks.verifiers_env import VerifiersError
from tests.verifiers04.helpers import call, expected_reward, needs_v1, vf04_task

pytestmark = [needs_v1, pytest.mark.usefixtures("keep_signal_handlers")]


def run(task, ts, replies, tools=None):
    tools = [] if tools is None else tools

    async def main():
        ep = task.make_env(ts)
        out = [await ep.reset(ts)]
        tools.extend(ep.tools or [])
        try:
            for r in replies:
                out.append(await ep.step(r))
                if out[-1].done:
                    break
        finally:
            await ep.close()
        return out

    return asyncio.run(main())


def test_dispatch_and_tasks():
    from inflight.tasks.verifiers_v1 import VerifiersV1Task

    task = get_task(vf04_task("single"))
    assert isinstance(task, VerifiersV1Task)
    assert len(task._train) == 8 and len(task.eval_samples()) == 4  # 12 tasks, the last eval_size held out
    ts = task.eval_samples()[0]  # task 8: 11 + 7*8 % 89 = 67, 13 + 5*8 % 83 = 53
    assert ts.messages == [{"role": "user", "content": "What is 67+53? Put the answer in \\boxed{}."}]
    assert ts.answer == "120"


def test_single_turn_reward_is_the_rubrics():
    task = get_task(vf04_task("single"))
    ts = task.eval_samples()[1]
    first, res = run(task, ts, [f"It is \\boxed{{{ts.answer}}}"])
    assert first == ts.messages  # the harness's first request is the task's prompt
    assert res.done and res.reward == 1.0 and res.info["vf_correct"] == 1.0
    _, res = run(task, ts, ["\\boxed{7}"])
    assert res.done and res.reward == 0.0
    assert task.verify(f"\\boxed{{{ts.answer}}}", ts).reward == 1.0


def test_multi_turn_env_user_turns_and_rubric():
    task = get_task(vf04_task("retry"))
    ts = task.eval_samples()[0]
    replies = ["a1", "b22", "c333"]
    first, r1, r2, r3 = run(task, ts, replies)
    assert first == [{"role": "user", "content": "Write the number 396 in digits."}]
    # the Env's run(): each reply answered by a user turn, three model turns in all, then scored
    assert r1.messages == r2.messages == [{"role": "user", "content": "Try again."}] and not r1.done
    assert r3.done and r3.reward == pytest.approx(6 / 9) == expected_reward("retry", replies, ts.answer)


def test_tool_env_mcp_tool_and_rubric():
    task = get_task(vf04_task("tool"))
    ts = task.eval_samples()[0]  # 67*53
    tools = []
    out = run(task, ts, [call("67*53"), f"So \\boxed{{{67 * 53}}}"], tools)
    # the reply with the call did not end the episode: verifiers answered it with a tool turn
    assert len(out) == 3 and not out[1].done, ("no tool turn after the call", out[1:])
    first, r1, r2 = out
    # the environment's messages as they are; the MCP server's tool list is the episode's `tools` (OpenAI's shape),
    # which the actor hands to the chat template or describes in a system message (actor/episode.py)
    assert first == ts.messages
    assert [t["function"]["name"] for t in tools] == ["calc"] and tools[0]["type"] == "function"
    assert tools[0]["function"]["parameters"]["type"] == "object"
    # the harness ran the call read from the reply text on verifiers' tool server and sent its result back
    assert r1.messages == [{"role": "tool", "content": "3551"}] and r1.info["tool_calls"] == 1 and not r1.done
    assert r2.done and r2.reward == 1.5 == expected_reward("tool", [call("67*53"), "So \\boxed{3551}"], ts.answer)
    assert r2.info["vf_correct"] == 1.0 and r2.info["vf_used_tool"] == 1.0
    # no call: the harness loop ends at the first reply; wrong answer, no tool
    _, r = run(task, ts, ["\\boxed{1}"])
    assert r.done and r.reward == 0.0


def test_bad_environments_get_clear_errors(tmp_path):
    with pytest.raises(VerifiersError, match="no such file"):
        get_task(vf04_task("single", env=str(tmp_path / "missing.py")))
    with pytest.raises(VerifiersError, match="task.eval_size=12"):
        get_task(vf04_task("single", eval_size=12))
    bad = tmp_path / "not_a_taskset.py"
    bad.write_text("x = 1\n")
    with pytest.raises(VerifiersError, match="__all__"):
        get_task(vf04_task("single", env=str(bad)))
