"""Dynamic sampling with refill (actor.dynamic_sampling), for real: a built-in server (`inflight serve`, HTTP), the
actor, and the trainer loop training the tiny model and pushing every version to the server over gloo, pipelined and
sync. The task is written here, so that which groups carry no signal is known: prompt k is always right (k % 5 == 0),
always wrong (k % 5 == 3), or half right (the others). Every optimizer step must hold groups_per_step informative
groups, every token's lag stay within the bound, and the dropped share logged be what the test counts."""

from __future__ import annotations

import asyncio
import itertools
import threading
from pathlib import Path

import pytest
import torch

from inflight.actor import Actor, ServerPool
from inflight.config import RunConfig
from inflight.config.limits import pipeline_limits, staleness
from inflight.config.trainer import TrainerConfig
from inflight.contracts import TaskSample, Verdict, Verification
from inflight.engine.serve import ServerProcess
from inflight.report.metrics import MetricsLogger
from inflight.report.page import Run, summary, write_report
from inflight.streams.memory import MemoryStream
from inflight.trainer.loop.trainer_loop import TrainerLoop
from inflight.trainer.single import SingleDeviceTrainer
from inflight.trainer.weight_sync import make_weight_sync
from tests.reliability.pipeline_helpers import free_port, records

pytestmark = pytest.mark.slow  # one inference server per test (~10-20 s on a busy 2-core machine)
torch.set_num_threads(1)
G, GPS = 4, 2
KINDS = ("right", "half", "half", "wrong", "half")


class KnownTask:
    """Prompt k of kind KINDS[k % 5] (`kinds` overrides); nothing held out."""

    def __init__(self, kinds: tuple[str, ...] = KINDS):
        self.kinds = kinds

    def train_samples(self, seed: int):
        for k in itertools.count():
            yield TaskSample(id=f"p{k}", messages=[{"role": "user", "content": f"{k % 10}+1="}], answer="",
                             meta={"kind": self.kinds[k % len(self.kinds)]})

    def eval_samples(self) -> list[TaskSample]:
        return []


class KnownScorer:
    """The task's verifier: the rewards its kind says, recorded with the completion lengths per prompt id."""

    def __init__(self):
        self.rewards: dict[str, list[float]] = {}
        self.tokens: dict[str, int] = {}

    async def score(self, items):
        ts = items[0][1]
        kind = ts.meta["kind"]
        rs = [float(kind == "right" or (kind == "half" and i % 2 == 0)) for i in range(len(items))]
        self.rewards[ts.id], self.tokens[ts.id] = rs, sum(n for _, _, _, n, _ in items)
        return [Verification(r, Verdict.correct if r else Verdict.wrong) for r in rs]


def run(model_dir: Path, run_dir: Path, mode: str, steps: int, kinds=KINDS, max_tries: int = 10, max_lag: int = 1):
    cfg = RunConfig()
    cfg.model.path = str(model_dir)
    a = cfg.actor
    a.group_size, a.groups_per_step, a.max_lag, a.max_new_tokens, a.eval_every = G, GPS, max_lag, 8, 0
    a.dynamic_sampling, a.dynamic_sampling_max_tries = True, max_tries
    a.concurrency_per_server, a.metrics_interval_s = 16, 60.0
    cfg.pipeline.mode, cfg.pipeline.num_grad_steps, cfg.pipeline.max_steps = mode, 2, steps
    cfg.pipeline.weight_sync_port, cfg.pipeline.tensorboard = free_port(), False
    cfg.trainer.threads = 1
    scorer = KnownScorer()
    with ServerProcess(str(model_dir), extra_args=["--threads", "1", "--max-model-len", "256"]) as server:
        policy = SingleDeviceTrainer(str(model_dir), TrainerConfig(threads=1, lr=1e-3))
        policy.init()
        stream = MemoryStream(capacity=staleness(cfg).stream_capacity)
        sync = make_weight_sync(cfg, [server.url])
        sync.init_process_group()
        log = MetricsLogger(run_dir, "trainer")
        loop = TrainerLoop(cfg, policy, stream, sync, log, run_dir)
        failed: list[BaseException] = []

        def train() -> None:
            try:
                loop.run()
            except BaseException as exc:  # handed to the test
                failed.append(exc)

        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()

        async def act() -> Actor:
            pool = ServerPool([server.url])
            try:
                actor = Actor(a, KnownTask(kinds), pool, scorer, stream, max_groups=pipeline_limits(cfg)[0],
                              staleness=staleness(cfg))
                await asyncio.wait_for(actor.run(), timeout=240)
                return actor
            finally:
                await pool.aclose()

        actor = asyncio.run(act())
        trainer.join(timeout=120)
        sync.close()
        log.close()
    assert not trainer.is_alive() and not failed, failed
    return records(run_dir, "train_step"), scorer, actor


def check_steps(steps: list[dict], scorer: KnownScorer, n: int, max_lag: int) -> tuple[set[int], set[int]]:
    assert [r["step"] for r in steps] == list(range(1, n + 1))
    trained: set[int] = set()
    dropped: set[int] = set()
    for r in steps:
        # groups_per_step informative groups: every sample has a nonzero advantage and is back-propagated
        assert r["samples"] == r["trained_samples"] == GPS * G and len(r["group_indices"]) == GPS
        assert all(len(set(scorer.rewards[t])) > 1 for t in r["task_ids"])
        assert r["groups_capped"] == 0
        # the refill's accounting: what this step passed over, and what its step cost in groups
        d = r["dropped_group_indices"]
        assert r["groups_dropped"] == len(d) and r["groups_generated"] == GPS + len(d)
        assert r["dropped_frac"] == pytest.approx(len(d) / (GPS + len(d)))
        assert r["tokens_dropped"] == sum(scorer.tokens[f"p{k}"] for k in d)
        assert all(len(set(scorer.rewards[f"p{k}"])) == 1 for k in d)
        # the staleness bound as before: no trained token more than max_lag versions behind the trained weights
        assert 0 <= r["lag_min"] <= r["lag_max"] <= max_lag
        trained |= set(r["group_indices"])
        dropped |= set(d)
    # every group started up to the last one trained was either trained or dropped (none failed here), and the
    # dropped ones are exactly those with equal rewards
    assert not trained & dropped and trained | dropped == set(range(max(trained) + 1))
    assert dropped == {k for k in range(max(trained) + 1) if KINDS[k % len(KINDS)] in ("right", "wrong")}
    return trained, dropped


@pytest.mark.parametrize("mode,max_lag", [("pipelined", 1), ("pipelined", 0), ("sync", 1)])
def test_every_step_holds_groups_per_step_informative_groups(tiny_model_dir, tmp_path, mode, max_lag):
    n = 6
    steps, scorer, actor = run(tiny_model_dir, tmp_path, mode, n, max_lag=max_lag)
    # sync mode: a round of num_grad_steps=2 steps is generated by one version (lag 0, then 1, whatever max_lag)
    trained, dropped = check_steps(steps, scorer, n, max_lag=max_lag)
    if mode == "sync":
        assert [r["lag_max"] for r in steps] == [0, 1] * (n // 2)
    # the actor dropped what the trainer passed over (and perhaps a few more it had no use for at the end)
    assert actor.metrics.groups_dropped >= len(dropped) and actor.metrics.groups_failed == 0
    # the report: the run's dropped share is the share the test counts, and the plot is there
    html = write_report([tmp_path]).read_text()
    assert (tmp_path / "plots" / "dynamic_sampling.png").stat().st_size > 1000 and "dynamic_sampling.png" in html
    s = summary(Run(tmp_path))
    assert s["dropped_pct"] == pytest.approx(100 * len(dropped) / (len(dropped) + len(trained)))
    assert s["generated_per_trained"] == pytest.approx((len(dropped) + len(trained)) / len(trained))
    assert s["capped_groups"] == 0


def test_a_solved_task_trains_its_last_tries_and_never_stalls(tiny_model_dir, tmp_path):
    """Every prompt always right: each place is tried max_tries times, then its last group is trained as it is
    (zero advantage, marked capped), so the run ends its steps instead of generating forever."""
    n = 3
    steps, scorer, actor = run(tiny_model_dir, tmp_path, "pipelined", n, kinds=("right",), max_tries=2)
    assert [r["step"] for r in steps] == list(range(1, n + 1))
    for r in steps:
        assert r["samples"] == GPS * G and r["groups_capped"] == GPS and r["trained_samples"] == 0
        assert r["lag_max"] <= 1
    assert sum(r["groups_dropped"] for r in steps) >= GPS * n  # each place's first try was dropped
    assert actor.metrics.groups_capped >= GPS * n
    warnings = records(tmp_path, "warning")
    assert [w["kind"] for w in warnings] == ["dynamic_sampling_cap"] and "max_tries=2" in warnings[0]["message"]
