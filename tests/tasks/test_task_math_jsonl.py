"""math_jsonl: loading jsonl/parquet, GSM8K answers, math-verify equivalences, labels, thread safety."""

import json
import threading
from itertools import islice

import pytest

from inflight.config.tasks import TaskConfig
from inflight.contracts import Verdict
from inflight.tasks import get_task

ROWS = [
    {"problem": "Half of one?", "solution": "\\frac{1}{2}"},
    {"problem": "Root of 8?", "solution": "2\\sqrt{2}"},
    {"problem": "Eggs?", "solution": "She sells 16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 1,018"},
    {"problem": "Pi-ish?", "solution": "\\sqrt{8}"},
    {"problem": "Interval?", "solution": "(0, 1]"},
]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return path


def _task(path, eval_size=2):
    return get_task(TaskConfig(name="math_jsonl", path=str(path), question_field="problem",
                               answer_field="solution", eval_size=eval_size))


def test_split_and_gsm8k_answers(jsonl):
    task = _task(jsonl)
    held = task.eval_samples()
    assert [s.answer for s in held] == ["\\sqrt{8}", "(0, 1]"]  # the last eval_size rows
    train = list(islice(task.train_samples(0), 6))
    assert {s.answer for s in train} == {"\\frac{1}{2}", "2\\sqrt{2}", "1018"}
    assert [s.id for s in train] == [s.id for s in islice(_task(jsonl).train_samples(0), 6)]  # seeded
    assert "Eggs?" in next(s for s in train if s.answer == "1018").messages[-1]["content"]


@pytest.mark.parametrize(
    "index, completion, finish, label",
    [
        (0, "so \\boxed{0.5}", "stop", Verdict.correct),
        (0, "\\boxed{\\frac{2}{4}}", "stop", Verdict.correct),
        (0, "\\boxed{\\dfrac12}", "stop", Verdict.correct),
        (0, "\\boxed{0.4}", "stop", Verdict.wrong),
        (1, "\\boxed{\\sqrt{8}}", "stop", Verdict.correct),
        (1, "\\boxed{2.8284271247}", "stop", Verdict.correct),
        (1, "\\boxed{3}", "stop", Verdict.wrong),
        (2, "\\boxed{1018}", "stop", Verdict.correct),
        (2, "\\boxed{1,018}", "stop", Verdict.correct),
        (2, "\\boxed{1019}", "stop", Verdict.wrong),
        (2, "the answer is 1018", "stop", Verdict.no_answer),
        (2, "\\boxed{}", "stop", Verdict.no_answer),
        (2, "\\boxed{10", "length", Verdict.truncated),
        (2, "\\boxed{@@}", "stop", Verdict.wrong),
        # only a finished answer counts: the one box ends the reply (closing math delimiters and a dot may follow)
        (2, "the answer is $\\boxed{1018}$.", "stop", Verdict.correct),
        (2, "\\[\\boxed{1018}\\]\n", "stop", Verdict.correct),
        (2, "**\\boxed{1018}**", "stop", Verdict.correct),
        (2, "\\boxed{1018} Let me check: 1018 - 9 = 1009", "stop", Verdict.no_answer),
        (2, "\\boxed{1019} no, \\boxed{1018}", "stop", Verdict.no_answer),
        (2, "\\boxed{1018}\\boxed}\\14", "length", Verdict.truncated),
        (2, "\\boxed{1018}$", "length", Verdict.correct),  # the text is finished; algo.truncated decides the rest
    ],
)
def test_verify_labels(jsonl, index, completion, finish, label):
    task = _task(jsonl, eval_size=1)
    sample = next(s for s in islice(task.train_samples(0), 10) if s.id == f"train-{index}")
    v = task.verify(completion, sample, finish)
    assert v.label == label, (completion, sample.answer, v)
    assert v.reward == (1.0 if label == Verdict.correct else 0.0)


def test_verify_off_the_main_thread(jsonl):
    task = _task(jsonl)
    held = task.eval_samples()
    out = []
    t = threading.Thread(target=lambda: out.append(task.verify("\\boxed{2\\sqrt{2}}", held[0])))
    t.start()
    t.join(30)
    assert out and out[0].label == Verdict.correct


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": f"q{i}", "answer": str(i)} for i in range(5)]), path)
    task = get_task(TaskConfig(name="math_jsonl", path=str(path), eval_size=2))
    assert [s.answer for s in task.eval_samples()] == ["3", "4"]
    assert task.verify("\\boxed{4}", task.eval_samples()[1]).label == Verdict.correct


def test_bad_input_is_a_clear_error(tmp_path, jsonl):
    with pytest.raises(ValueError, match="task.path"):
        get_task(TaskConfig(name="math_jsonl"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        get_task(TaskConfig(name="math_jsonl", path=str(tmp_path / "missing.jsonl")))
    with pytest.raises(ValueError, match="lacks field 'question'"):
        get_task(TaskConfig(name="math_jsonl", path=str(jsonl), eval_size=1))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "1"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        get_task(TaskConfig(name="math_jsonl", path=str(bad), eval_size=1))
