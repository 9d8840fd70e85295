"""reasoning_gym: an offline procedural dataset, its own scorer, seeded and disjoint splits."""

from itertools import islice

import pytest

from inflight.config.tasks import TaskConfig
from inflight.contracts import Verdict
from inflight.tasks import get_task


def _task(**kw):
    return get_task(TaskConfig(name="reasoning_gym", dataset="basic_arithmetic", eval_size=20, **kw))


def test_offline_dataset_seeded_and_disjoint():
    a, b = _task(), _task()
    assert [s.messages for s in islice(a.train_samples(0), 20)] == [s.messages for s in islice(b.train_samples(0), 20)]
    held = {s.meta["question"] for s in a.eval_samples()}
    assert len(a.eval_samples()) == 20
    assert not held & {s.meta["question"] for s in islice(a.train_samples(0), 500)}
    assert "\\boxed{}" in a.eval_samples()[0].messages[-1]["content"]


def test_scorer_labels():
    task = _task()
    s = task.eval_samples()[0]
    assert task.verify(f"so \\boxed{{{s.answer}}}", s) .label == Verdict.correct
    assert task.verify(f"\\boxed{{{int(s.answer) + 1}}}", s).label == Verdict.wrong
    assert task.verify(s.answer, s).label == Verdict.no_answer
    assert task.verify("\\boxed{1", s, "length").label == Verdict.truncated
    # only a finished answer counts: junk or a second box after the answer earns nothing
    assert task.verify(f"\\boxed{{{s.answer}}}$.", s).label == Verdict.correct
    assert task.verify(f"\\boxed{{{s.answer}}} and more", s).label == Verdict.no_answer
    assert task.verify(f"\\boxed{{{s.answer}}}\\boxed{{{s.answer}}}", s).label == Verdict.no_answer
    assert task.verify(f"\\boxed{{{s.answer}}}\\boxed}}\\1", s, "length").label == Verdict.truncated
    # a sample regenerates from its meta in a fresh task object (e.g. another process)
    assert _task().verify(f"\\boxed{{{s.answer}}}", s).reward == 1.0


def test_unknown_and_unsupported_datasets():
    with pytest.raises(ValueError, match="basic_arithmetic"):
        get_task(TaskConfig(name="reasoning_gym", dataset="basic_arithmetik"))
    with pytest.raises(ValueError, match="not supported"):
        get_task(TaskConfig(name="reasoning_gym", dataset="composite"))
