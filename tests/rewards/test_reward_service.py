"""RewardService: real task labels, hung / raising / crashing verifiers, timeouts, reward table, and what each
truncation mode (algo.truncated) does to the reward of a completion the length limit cut off."""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from inflight.config.tasks import TaskConfig
from inflight.contracts import TaskSample, Verdict
from inflight.rewards import RewardService
from inflight.tasks import get_task

FNS = "rewardfns:verify"


def _item(text: str, answer: str = "42", finish: str = "stop", n: int = 4, max_tokens: int = 16):
    return (text, TaskSample(id=f"s-{text}", messages=[{"role": "user", "content": "q"}], answer=answer), finish, n,
            max_tokens)


@pytest.fixture(scope="module")
def service():
    with RewardService(TaskConfig(), workers=2, timeout_s=1.0, verify_fn=FNS) as s:
        yield s


def test_arith_task_labels():
    cfg = TaskConfig(name="arith", digits=2)
    task = get_task(cfg)
    rng = random.Random(0)
    samples = [s for s, _ in zip(task.train_samples(seed=1), range(6))]
    items, expected = [], []
    for s in samples:
        items += [(task.solution(s), s, "stop", 10, 64), (task.wrong_solution(s, rng), s, "stop", 10, 64),
                  ("I think", s, "stop", 2, 64), ("I think", s, "length", 64, 64)]
        expected += [Verdict.correct, Verdict.wrong, Verdict.no_answer, Verdict.truncated]
    with RewardService(cfg, workers=2, timeout_s=10.0) as rs:
        out = asyncio.run(rs.score(items))
        assert rs.stats["calls"] == len(items) and rs.replaced_workers == 0
    assert [v.label for v in out] == expected
    assert [v.reward for v in out] == [1.0 if e == Verdict.correct else 0.0 for e in expected]


def test_runs_in_other_processes():
    with RewardService(TaskConfig(), workers=2, verify_fn="rewardfns:pid_verify") as rs:
        pids = {int(v.reward) for v in rs.score_sync([_item(str(i)) for i in range(20)])}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


def test_hang_raise_crash_are_labelled_and_service_continues(service, caplog):
    caplog.set_level("WARNING", logger="inflight.rewards")
    texts = ["42", "hang", "raise", "7", "crash", "", "42"]
    t0 = time.monotonic()
    out = asyncio.run(service.score([_item(t) for t in texts]))
    wall = time.monotonic() - t0
    assert [v.label for v in out] == [Verdict.correct, Verdict.error, Verdict.error, Verdict.wrong, Verdict.error,
                                      Verdict.no_answer, Verdict.correct]
    assert [v.reward for v in out] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert wall < 60  # the hung verifier sleeps 1e6 s: only the 1 s timeout ends it
    assert service.stats["timeout"] == 1 and service.stats["raised"] == 1 and service.stats["crashed"] == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "inflight.rewards"]
    assert any("timeout" in m and "s-hang" in m for m in logged)
    assert any("ZeroDivisionError: verifier bug" in m for m in logged)
    # the batch holding the hung one and then the hung one alone (killed), the same for the crashed one; a raise
    # keeps its worker
    assert service.replaced_workers == 4
    # later calls, from another event loop, still work on the replacement workers
    again = asyncio.run(service.score([_item("42"), _item("41"), _item("", finish="length")]))
    assert [v.label for v in again] == [Verdict.correct, Verdict.wrong, Verdict.truncated]


def test_two_hangs_at_once_do_not_block_the_pool(service):
    before = service.replaced_workers
    t0 = time.monotonic()
    out = service.score_sync([_item("hang"), _item("hang"), _item("42")])
    assert [v.label for v in out] == [Verdict.error, Verdict.error, Verdict.correct]
    assert service.replaced_workers == before + 3  # their batch, then each alone
    assert time.monotonic() - t0 < 60


def test_a_group_is_one_round_trip_per_worker(service):
    """Completions are sent in batches (up to one per worker), not one pipe round trip each."""
    calls = []
    real = service._pool.call
    service._pool.call = lambda args, timeout_s: calls.append(len(args[0])) or real(args, timeout_s)
    try:
        out = asyncio.run(service.score([_item(t) for t in ["42", "41", "42", "", "42"]]))
    finally:
        service._pool.call = real
    assert [v.label for v in out] == [Verdict.correct, Verdict.wrong, Verdict.correct, Verdict.no_answer,
                                      Verdict.correct]
    assert sorted(calls) == [2, 3]


def _dapo_penalty(n: int, max_tokens: int, p: float, frac: float) -> float:
    buf = frac * max_tokens
    if n <= max_tokens - buf:
        return 0.0
    if n <= max_tokens:
        return p * (n - (max_tokens - buf)) / buf
    return p


def test_reward_table_and_overlong_penalty():
    table = {"wrong": -0.5, Verdict.truncated: -1.0, "error": -2.0}
    with RewardService(TaskConfig(), workers=1, timeout_s=1.0, verify_fn=FNS, reward_table=table,
                       truncated="soft_penalty", overlong_penalty=0.5, overlong_buffer=0.25) as rs:
        # max_tokens 16, buffer 4 tokens: penalty 0 up to 12 tokens, then 0.125 per token, 0.5 from 16 on
        items = [_item("42", n=12), _item("42", n=13), _item("42", n=16), _item("41", n=14),
                 _item("", "42", "length", 16), _item("partial", n=5), _item("raise", n=15),
                 _item("42", n=3, max_tokens=0)]
        out = rs.score_sync(items)
    assert [v.label for v in out] == [Verdict.correct, Verdict.correct, Verdict.correct, Verdict.wrong,
                                      Verdict.truncated, Verdict.wrong, Verdict.error, Verdict.correct]
    # by hand: correct keeps the verifier's 1.0; the table overrides wrong/truncated/error
    hand = [1.0, 0.875, 0.5, -0.75, -1.5, -0.5, -2.375, 1.0]
    assert [v.reward for v in out] == pytest.approx(hand, abs=1e-12)
    # the same from a plain reference of DAPO's formula
    ref = [1.0 - _dapo_penalty(12, 16, 0.5, 0.25), 1.0 - _dapo_penalty(13, 16, 0.5, 0.25),
           1.0 - _dapo_penalty(16, 16, 0.5, 0.25), -0.5 - _dapo_penalty(14, 16, 0.5, 0.25),
           -1.0 - _dapo_penalty(16, 16, 0.5, 0.25)]
    assert [v.reward for v in out[:5]] == pytest.approx(ref, abs=1e-12)
    assert rs.penalty(40, 16) == 0.5  # capped beyond the limit


@pytest.mark.parametrize("mode", ["keep", "mask", "zero_reward", "soft_penalty"])
def test_truncation_modes_on_rewards(mode):
    """The same five completions (max_tokens 10) under each mode: which rewards and labels change, by hand."""
    items = [_item("42", n=5, max_tokens=10),                   # finished, short, correct
             _item("42", n=10, max_tokens=10),                  # finished at the limit's length (EOS last)
             _item("42", "42", "length", 10, 10),                # cut off, its text a correct answer
             _item("41", "42", "length", 10, 10),                # cut off, wrong
             _item("partial", "42", "length", 9, 10)]           # cut off at 9 tokens (e.g. a stop mid-token)
    with RewardService(TaskConfig(), workers=1, timeout_s=5.0, verify_fn=FNS, truncated=mode) as rs:
        out = rs.score_sync(items)
    verifier = ([1.0, 1.0, 1.0, 0.0, 0.25], [Verdict.correct, Verdict.correct, Verdict.correct, Verdict.wrong,
                                               Verdict.wrong])
    if mode in ("keep", "mask"):  # the verifier's word (mask acts in the trainer)
        expect = verifier
    elif mode == "zero_reward":  # every cut-off completion: reward 0, label truncated
        expect = ([1.0, 1.0, 0.0, 0.0, 0.0], [Verdict.correct, Verdict.correct] + [Verdict.truncated] * 3)
    else:  # DAPO, penalty 1 over the last 20% (2 tokens): 0 up to 8 tokens, 0.5 at 9, 1 at 10, finished or not
        expect = ([1.0, 0.0, 0.0, -1.0, 0.25 - 0.5], verifier[1])
    assert [v.reward for v in out] == pytest.approx(expect[0], abs=1e-12)
    assert [v.label for v in out] == expect[1]


def test_zero_reward_uses_the_tables_truncated_reward():
    with RewardService(TaskConfig(), workers=1, verify_fn=FNS, truncated="zero_reward",
                       reward_table={"truncated": -0.5, "wrong": -0.25}) as rs:
        out = rs.score_sync([_item("42", finish="length"), _item("41"), _item("41", finish="length")])
    assert [(v.reward, v.label) for v in out] == [(-0.5, Verdict.truncated), (-0.25, Verdict.wrong),
                                                  (-0.5, Verdict.truncated)]


def test_default_table_uses_verifier_rewards(service):
    out = service.score_sync([_item("partial"), _item("42", n=16)])  # no penalty configured
    assert [v.reward for v in out] == [0.25, 1.0]


def test_bad_configuration_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown labels"):
        RewardService(TaskConfig(), reward_table={"right": 1.0})
    with pytest.raises(ValueError, match="overlong"):
        RewardService(TaskConfig(), truncated="soft_penalty", overlong_penalty=-1)
    with pytest.raises(ValueError, match="zero_reward"):
        RewardService(TaskConfig(), truncated="drop")
    rs = RewardService(TaskConfig(), workers=1, verify_fn="rewardfns:no_such_function")
    with pytest.raises(RuntimeError, match="no_such_function"):
        rs.start()
