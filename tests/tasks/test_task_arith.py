"""arith: seeded generation, held-out split, solutions and the verifier's labels."""

import random
from itertools import islice

import pytest

from inflight.config.tasks import TaskConfig
from inflight.contracts import Verdict
from inflight.tasks import get_task
from inflight.tasks.arith import evaluate, parse_expr


def _first(task, n=50, seed=0):
    return [(s.id, s.messages, s.answer) for s in islice(task.train_samples(seed), n)]


def test_deterministic_for_a_seed():
    cfg = TaskConfig(digits=3, terms=3, operators=["+", "-", "*"], eval_size=50)
    a, b = get_task(cfg), get_task(cfg)
    assert _first(a) == _first(b)
    assert [s.answer for s in a.eval_samples()] == [s.answer for s in b.eval_samples()]
    assert _first(a, seed=0) != _first(a, seed=1)
    other = get_task(TaskConfig(digits=3, terms=3, operators=["+", "-", "*"], eval_size=50, seed=1))
    assert [s.meta["expr"] for s in other.eval_samples()] != [s.meta["expr"] for s in a.eval_samples()]


def test_eval_split_is_disjoint_and_distinct():
    task = get_task(TaskConfig(digits=1, terms=2, eval_size=60))  # 100 possible problems: collisions are certain
    held = [s.meta["expr"] for s in task.eval_samples()]
    assert len(held) == len(set(held)) == 60
    train = {s.meta["expr"] for s in islice(task.train_samples(0), 2000)}
    assert not train & set(held)
    assert len(train) == 40  # every other problem still shows up


def test_too_small_problem_space_is_a_clear_error():
    with pytest.raises(ValueError, match="eval_size"):
        get_task(TaskConfig(digits=1, terms=2, eval_size=101))
    with pytest.raises(ValueError, match="operators"):
        get_task(TaskConfig(operators=["/"]))


def test_difficulty_and_answers():
    task = get_task(TaskConfig(digits=3, terms=4, operators=["-", "*"], eval_size=10))
    for s in islice(task.train_samples(0), 100):
        nums, ops = parse_expr(s.meta["expr"])
        assert len(nums) == 4 and set(ops) <= {"-", "*"} and all(0 <= n < 1000 for n in nums)
        # plain-Python reference with the usual precedence
        assert int(s.answer) == eval(s.meta["expr"])  # noqa: S307 - our own digits and operators only
        assert "\\boxed{}" in s.messages[-1]["content"]
    assert evaluate([2, 3, 4], ["+", "*"]) == 14 and evaluate([2, 3, 4], ["-", "-"]) == -5


def test_solutions_are_short_and_verify():
    task = get_task(TaskConfig(eval_size=10))
    rng = random.Random(0)
    for s in islice(task.train_samples(0), 200):
        sol = task.solution(s)
        assert sol == f"\\boxed{{{s.answer}}}"
        assert task.verify(sol, s).label == Verdict.correct
        wrong = task.wrong_solution(s, rng)
        assert task.verify(wrong, s) .label == Verdict.wrong


def test_scratchpad_lengths_vary_and_are_right():
    task = get_task(TaskConfig(digits=4, terms=6, operators=["+", "-", "*"], scratchpad=True, eval_size=10))
    lengths = []
    for s in islice(task.train_samples(0), 200):
        sol = task.solution(s)
        lengths.append(len(sol))
        assert sol.endswith(f"\\boxed{{{s.answer}}}")
        assert task.verify(sol, s).reward == 1.0
        assert task.verify(task.wrong_solution(s, random.Random(1)), s).reward == 0.0
    assert min(lengths) < 80 and max(lengths) > 400  # tens to hundreds of tokens (digits are single tokens)


@pytest.mark.parametrize(
    "completion, finish, label",
    [
        ("\\boxed{46}", "stop", Verdict.correct),
        ("12+34 is \\boxed{ 46 }", "stop", Verdict.correct),
        ("\\boxed{46}\n  ", "stop", Verdict.correct),  # whitespace after the box is fine
        ("\\boxed{47}", "stop", Verdict.wrong),
        ("\\boxed{46.0}", "stop", Verdict.wrong),  # exact integer compare
        ("\\boxed{forty six}", "stop", Verdict.wrong),
        ("46", "stop", Verdict.no_answer),
        ("", "stop", Verdict.no_answer),
        ("\\boxed{46", "stop", Verdict.no_answer),  # malformed: never closed
        # only a finished answer counts: one box, nothing after it but whitespace
        ("\\boxed{45} no wait \\boxed{46}", "stop", Verdict.no_answer),  # two boxes: a hedge, not one answer
        ("\\boxed{46} no wait \\boxed{45}", "stop", Verdict.no_answer),
        ("\\boxed{46}\\boxed{46}", "stop", Verdict.no_answer),
        ("\\boxed{46}.", "stop", Verdict.no_answer),  # arith is strict: a tiny model has no reason to add a dot
        ("\\boxed{46}\\}\\boxed}", "stop", Verdict.no_answer),  # junk after the answer, ended
        ("\\boxed{46}\\boxed}\\14", "length", Verdict.truncated),  # ... and cut off by the limit
        ("\\boxed{46}}", "length", Verdict.truncated),
        ("\\boxed{4", "length", Verdict.truncated),
        # a cut-off reply whose text is one finished box: the text is right; algo.truncated decides what it earns
        ("\\boxed{46}", "length", Verdict.correct),
    ],
)
def test_verify_labels(completion, finish, label):
    task = get_task(TaskConfig(eval_size=5))
    sample = next(s for s in islice(task.train_samples(0), 10_000) if s.answer == "46")
    v = task.verify(completion, sample, finish)
    assert v.label == label
    assert v.reward == (1.0 if label == Verdict.correct else 0.0)


def test_negative_answers_compare_exactly():
    task = get_task(TaskConfig(operators=["-"], eval_size=5))
    s = next(s for s in task.train_samples(0) if int(s.answer) < 0)
    assert task.verify(f"\\boxed{{{s.answer}}}", s).label == Verdict.correct
    assert task.verify(f"\\boxed{{{-int(s.answer)}}}", s).label == Verdict.wrong


def test_unknown_task_name():
    with pytest.raises(ValueError, match="arith"):
        get_task(TaskConfig(name="arithmetic"))


def test_last_number_answer_format_reads_what_small_instruct_models_write():
    from inflight.tasks.answer import last_number

    assert [last_number(t) for t in ("2 + 7 = 9", "The sum is 12.", "3 - 8 = -5", "1,234", "x = 3.5", "none")] == \
        ["9", "12", "-5", "1234", "3.5", None]
    task = get_task(TaskConfig(digits=1, eval_size=10, answer_format="last_number",
                               system_prompt="You are a calculator."))
    s = task.eval_samples()[0]
    assert s.messages[0] == {"role": "system", "content": "You are a calculator."}
    assert s.messages[1]["content"].endswith("Answer with the number only.") and "boxed" not in s.messages[1]["content"]
    a, b = map(int, s.meta["expr"].split("+"))
    assert task.verify(f"{a} + {b} = {a + b}", s).label == Verdict.correct
    assert task.verify(f"\\boxed{{{a + b}}}", s).label == Verdict.correct
    assert task.verify(f"{a} + {b} = {a + b + 1}", s).label == Verdict.wrong
    assert task.verify("I do not know.", s).label == Verdict.no_answer
    # cut off by the length limit: the last digits may be missing, so no answer counts
    assert task.verify(f"{a} + {b} = {a + b}", s, "length").label == Verdict.truncated
    # the boxed default reads only the box and has no system message unless asked
    boxed = get_task(TaskConfig(digits=1, eval_size=10))
    assert [m["role"] for m in boxed.eval_samples()[0].messages] == ["user"]
    assert boxed.verify(f"{a} + {b} = {a + b}", s).label == Verdict.no_answer


def test_unknown_answer_format_is_a_clear_error():
    with pytest.raises(ValueError, match="answer_format must be one of"):
        get_task(TaskConfig(answer_format="last_word"))
    with pytest.raises(ValueError, match="answer_format must be 'boxed'"):
        get_task(TaskConfig(name="math_jsonl", path="x.jsonl", answer_format="last_number"))
