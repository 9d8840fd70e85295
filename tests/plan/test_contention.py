"""Roles sharing cores: slowdowns from the time spent in each busy state, computed by hand, and the fixed point."""

from __future__ import annotations

import dataclasses

import pytest

from inflight_plan.contention import simulate_shared, slowdowns, slowed
from inflight_plan.sim import simulate
from inflight_plan.workload import Lengths, SimConfig
from tests.plan.test_sim import flat_profile


def test_slowdowns_by_hand():
    # 2 cores. 1 s trainer alone, 1 s trainer + server, 2 s trainer + server + actor (3 threads: 1.5x slower)
    occ = {(1, 0, 0, 0, 0): 1.0, (1, 1, 0, 0, 0): 1.0, (1, 1, 0, 0, 1): 2.0, (0, 0, 0, 0, 0): 5.0}
    t, s, a = slowdowns(occ, cores=2)
    assert t == pytest.approx((1 + 1 + 2 * 1.5) / 4)
    assert s == pytest.approx((1 + 2 * 1.5) / 3)
    assert a == pytest.approx(1.5)
    assert slowdowns(occ, cores=4) == (1.0, 1.0, 1.0)  # enough cores: nobody waits
    # measured co-run factors apply only while the trainer and a server both compute, on top of the sharing
    t, s, a = slowdowns(occ, cores=2, corun=(1.2, 1.1))
    assert t == pytest.approx((1 + 1.2 + 2 * 1.5 * 1.2) / 4)
    assert s == pytest.approx((1.1 + 2 * 1.5 * 1.1) / 3)
    assert a == pytest.approx(1.5)  # the actor has no co-run factor
    assert slowdowns(occ, cores=4, corun=(1.2, 1.1)) == pytest.approx(((1 + 3 * 1.2) / 4, 1.1, 1.0))
    # a server's HTTP thread is a thread of its own: engine + HTTP + actor want 3 threads; `server_threads` counts
    # the engine's compute threads only; the co-run factor needs the engine computing
    assert slowdowns({(0, 1, 0, 1, 1): 1.0}, cores=2) == pytest.approx((1.0, 1.5, 1.5))
    assert slowdowns({(0, 1, 0, 1, 0): 1.0}, cores=2, server_threads=2) == pytest.approx((1.0, 1.5, 1.0))
    assert slowdowns({(1, 0, 0, 1, 0): 1.0}, cores=2, corun=(1.2, 1.1)) == (1.0, 1.0, 1.0)
    # an engine stalled by its HTTP thread wants a core for the `stalled` share: trainer + HTTP + actor + 0.5 x
    # engine = 3.5 threads on 2 cores
    assert slowdowns({(1, 0, 1, 1, 1): 1.0}, cores=2, stalled=0.5) == pytest.approx((1.75, 1.75, 1.75))
    assert slowdowns({(1, 0, 1, 1, 1): 1.0}, cores=2) == pytest.approx((1.5, 1.5, 1.5))


def test_slowed_profile_scales_every_role():
    p = flat_profile(step_s=0.01, tok_s=1000.0, prefill=500.0, pause=0.1).model_copy(update={"actor_s_per_group": 0.2})
    q = slowed(p, trainer=2.0, server=1.5, actor=3.0)
    assert q.trainer.tokens_per_s == pytest.approx(500.0)
    assert q.engine.decode.step_time(64, 1) == pytest.approx(0.015)
    assert q.engine.prefill_tokens_per_s == pytest.approx(500.0 / 1.5)
    assert q.pause_s == pytest.approx(0.15) and q.actor_s_per_group == pytest.approx(0.6)


def test_sync_alternates_so_nothing_slows_but_pipelined_overlap_does():
    prof = flat_profile(tok_s=25600.0).model_copy(update={"actor_s_per_group": 0.001})
    base = SimConfig(servers=1, max_batch=128, group_size=8, groups_per_step=16, prompt_tokens=0,
                     lengths=Lengths("fixed:10"), steps=16)
    sync = simulate_shared(prof, dataclasses.replace(base, mode="sync"), cores=2)
    assert sync.extra["slowdown"]["trainer"] == pytest.approx(1.0)  # trains while the server idles
    pipe = simulate_shared(prof, dataclasses.replace(base, max_lag=1), cores=2)
    assert pipe.extra["slowdown"]["server"] > 1.0  # decodes while the trainer and the actor run
    assert pipe.samples_per_s < simulate(prof, dataclasses.replace(base, max_lag=1)).samples_per_s
    assert simulate_shared(prof, dataclasses.replace(base, max_lag=1), cores=3).extra["slowdown"] == {
        "trainer": 1.0, "server": 1.0, "actor": 1.0}
