"""A run's engine steps against plain decode steps (inflight_plan/traffic.py): the factor as the simulator applies
it, and the ratio it is computed as (the factor measured on a tiny model: test_profile_and_cli.py)."""

from __future__ import annotations

import dataclasses

import pytest

from inflight_plan.profile import TrainerProfile
from inflight_plan.sim import simulate
from inflight_plan.traffic import _curve_s, _measured_s
from tests.plan.test_profile_and_cli import small_profile
from tests.plan.test_sim import BASE


def server_bound(factor: float):
    """Only the server costs time: an instant trainer, no push, pause, reply or latency."""
    p = small_profile()
    return p.model_copy(update={
        "engine": p.engine.model_copy(update={"run_step_factor": factor}),
        "trainer": TrainerProfile(tokens_per_s=1e12), "push_s": 0.0, "pause_s": 0.0, "overhead_s": 0.0})


@pytest.mark.parametrize("mode", ["pipelined", "sync"])
def test_steps_that_cost_twice_as_much_halve_a_server_bound_loop(mode):
    cfg = dataclasses.replace(BASE, mode=mode, max_lag=1 if mode == "pipelined" else 0, prompt_tokens=20)
    plain, run = simulate(server_bound(1.0), cfg), simulate(server_bound(2.0), cfg)
    assert run.samples_per_s == pytest.approx(plain.samples_per_s / 2, rel=1e-6)  # decode and prefill alike
    assert run.lag_hist == plain.lag_hist


def test_the_factor_is_measured_seconds_over_the_curves_seconds():
    eng = small_profile().engine  # 12 ms at batch 16, context 32; 20000 prefill tokens/s
    trace = [(16, 16 * 32, 0, 0.018), (16, 16 * 32, 200, 0.030), (0, 0, 50, 0.5)]  # the prefill-only step: ignored
    curve = 0.012 + (0.012 + 200 / 20000)
    assert _curve_s(eng, trace) == pytest.approx(curve)
    assert _measured_s(trace) / _curve_s(eng, trace) == pytest.approx(0.048 / curve)
