"""arith_tool: the calculator (ast-parsed integer arithmetic, nothing else) and the episode's environment."""

import pytest

from inflight.config.tasks import TaskConfig
from inflight.contracts import EnvTask, StepResult
from inflight.tasks import get_task
from inflight.tasks.arith_tool import CalcError, calculate


@pytest.mark.parametrize("expr,value", [
    ("123*456", 56088), (" 2 + 3*4 ", 14), ("(2+3)*4", 20), ("-7+2", -5), ("17//5", 3), ("17%5", 2),
    ("1234×5678", 1234 * 5678), ("+3", 3),
])
def test_calculate(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr,why", [
    ("__import__('os').system('true')", "unsupported"), ("2**10", "unsupported"), ("2.5*2", "unsupported"),
    ("1/0", "unsupported"), ("1//0", "division by zero"), ("abc", "unsupported"), ("1+", "not an arithmetic"),
    ("1+" * 150, "longer than"), ("True+1", "unsupported"),
])
def test_calculate_rejects_everything_else(expr, why):
    with pytest.raises(CalcError, match=why):
        calculate(expr)


def test_magnitude_bound(monkeypatch):
    import inflight.tasks.arith_tool as at

    monkeypatch.setattr(at, "MAX_DIGITS", 10)
    assert calculate("99999*99999") == 99999 * 99999
    with pytest.raises(CalcError, match="too large"):
        calculate("999999*999999")


def test_environment_episode():
    task = get_task(TaskConfig(name="arith_tool", digits=4, terms=3, operators=["*", "+"], eval_size=5))
    assert isinstance(task, EnvTask)
    ts = next(task.train_samples(0))
    assert "<calc>" in ts.messages[-1]["content"] and "\\boxed{}" in ts.messages[-1]["content"]
    env = task.make_env(ts)
    assert env.reset(ts) == ts.messages
    r = env.step(f"Let me compute. <calc>{ts.meta['expr']}</calc>")
    assert r == StepResult(messages=[{"role": "tool", "content": ts.answer}], info={"tool_calls": 1.0,
                                                                                    "tool_errors": 0.0})
    r = env.step("<calc>2**99")  # unclosed at the end of a reply (a stop string cut it): still a call
    assert r.messages[0]["content"].startswith("error: unsupported") and r.info["tool_errors"] == 1.0
    assert not r.done
    assert env.step(f"The answer is \\boxed{{{ts.answer}}}") == StepResult(reward=1.0, done=True)
    assert env.step("The answer is \\boxed{-1}") == StepResult(reward=0.0, done=True)
    assert env.step("no idea") == StepResult(reward=0.0, done=True)
    # the held-out split is the arith one's, with the tool prompt
    assert [s.answer for s in task.eval_samples()] == [s.answer for s in get_task(
        TaskConfig(digits=4, terms=3, operators=["*", "+"], eval_size=5)).eval_samples()]
    role = get_task(TaskConfig(name="arith_tool", tool_role="user", eval_size=2))
    assert role.make_env(ts).step("<calc>1+1</calc>").messages == [{"role": "user", "content": "2"}]


def test_tool_demo_is_one_worked_exchange_before_the_question():
    plain = next(get_task(TaskConfig(name="arith_tool", system_prompt="S", eval_size=2)).train_samples(0))
    demo = next(get_task(TaskConfig(name="arith_tool", system_prompt="S", eval_size=2, tool_demo=True,
                                    tool_role="user")).train_samples(0))
    assert demo.messages[0] == plain.messages[0] and demo.messages[-1] == plain.messages[-1]
    assert demo.messages[1:-1] == [
        {"role": "user", "content": plain.messages[-1]["content"].replace(plain.meta["expr"], "12*34")},
        {"role": "assistant", "content": "<calc>12*34</calc>"}, {"role": "user", "content": "408"},
        {"role": "assistant", "content": "\\boxed{408}"}]
