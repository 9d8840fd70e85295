"""The simulator against cases computed by hand, and its invariants (staleness bound, busy shares, determinism)."""

from __future__ import annotations

import dataclasses

import pytest

from inflight_plan.profile import DecodeCurve, EngineProfile, Profile, TrainerProfile
from inflight_plan.sim import simulate
from inflight_plan.workload import Lengths, SimConfig


def flat_profile(step_s: float = 0.01, tok_s: float = 1e12, prefill: float = 1e12, push: float = 0.0,
                 pause: float = 0.0, overhead: float = 0.0) -> Profile:
    return Profile(source="hand-made test profile",
                   engine=EngineProfile(decode=DecodeCurve(batches=[1, 128], contexts=[1], step_s=[[step_s, step_s]]),
                                        prefill_tokens_per_s=prefill, max_batch=128),
                   trainer=TrainerProfile(tokens_per_s=tok_s), push_s=push, pause_s=pause, overhead_s=overhead)


BASE = SimConfig(servers=1, max_batch=128, group_size=8, groups_per_step=16, prompt_tokens=0,
                 lengths=Lengths("fixed:10"), steps=16)


def steady(r, first: int = 4) -> float:
    return r.steady_samples_per_s(first)


def test_generation_bound_rate_is_batch_over_length_times_step():
    # 128 sequences of 10 tokens per step, one full batch of 128, 10 ms a step: 128 / (10 x 0.01) = 1280 samples/s
    for mode in ("pipelined", "sync"):
        r = simulate(flat_profile(), dataclasses.replace(BASE, mode=mode))
        assert r.samples_per_s == pytest.approx(1280.0, rel=1e-6)
        assert r.server_mean_batch == pytest.approx(128.0)
        assert r.server_tokens_per_s == pytest.approx(12800.0, rel=1e-6)


def test_training_time_adds_in_sync_and_on_policy_but_overlaps_with_lag():
    # one step: generation 10 x 10 ms = 0.1 s; training 1280 tokens at 25,600 tok/s = 0.05 s
    prof = flat_profile(tok_s=25600.0)
    sync = simulate(prof, dataclasses.replace(BASE, mode="sync", num_grad_steps=4))
    assert steady(sync) == pytest.approx(512 / (0.4 + 0.2), rel=1e-6)  # a round: 4 x 0.1 generate, then 4 x 0.05
    on_policy = simulate(prof, dataclasses.replace(BASE, max_lag=0))
    assert steady(on_policy) == pytest.approx(128 / 0.15, rel=1e-6)  # generate, train, generate...
    lag1 = simulate(prof, dataclasses.replace(BASE, max_lag=1))
    assert steady(lag1) == pytest.approx(1280.0, rel=1e-6)  # training hidden behind generation
    assert lag1.trainer_busy == pytest.approx(0.5, rel=0.05)
    assert sync.trainer_busy == pytest.approx(1 / 3, rel=0.05)


def test_trainer_bound_rate_and_step_overhead():
    # training 0.2 s per step (+ 0.05 s optimizer) > generation 0.1 s: the trainer sets the pace
    prof = flat_profile(tok_s=6400.0).model_copy(update={"trainer": TrainerProfile(tokens_per_s=6400.0,
                                                                                   step_overhead_s=0.05)})
    r = simulate(prof, dataclasses.replace(BASE, max_lag=2))
    assert steady(r) == pytest.approx(128 / 0.25, rel=1e-6)
    assert r.trainer_busy > 0.95
    half = simulate(prof, dataclasses.replace(BASE, max_lag=2, trained_frac=0.5))  # zero-advantage samples skipped
    assert steady(half) == pytest.approx(128 / 0.15, rel=1e-6)  # 0.1 s training + 0.05 s optimizer


def test_trainer_charges_each_groups_prompt_once_at_the_measured_forward_rate():
    # The trainer runs a group's prompt once (trainer/prefix.py). The profile's 6400 tokens/s counted prompt +
    # completion of every sample on 8-token prompts, 24-token completions, groups of 8: its forward ran over
    # (8 + 8 x 24) / (8 x (8 + 24)) = 0.78125 of those, 5000 tokens/s. A group here: 40-token prompt + 8 x 10
    # completion tokens = 120 forward tokens, half of them trained (zero-advantage groups skipped).
    trainer = TrainerProfile(tokens_per_s=6400.0, prompt_tokens=8, completion_tokens=24, group_size=8)
    assert trainer.forward_share() == pytest.approx(200 / 256)
    assert trainer.forward_tokens_per_s_at(1) == pytest.approx(5000.0)
    prof = flat_profile().model_copy(update={"trainer": trainer})
    cfg = dataclasses.replace(BASE, max_lag=2, prompt_tokens=40, trained_frac=0.5)
    step_s = 16 * 0.5 * (40.0 + 8 * 10.0) / (6400.0 * (8 + 8 * 24) / (8 * (8 + 24)))  # 0.192 s > 0.1 s generating
    r = simulate(prof, cfg)
    assert steady(r) == pytest.approx(128 / step_s, rel=1e-6)
    # prompt counted per sample, as before (16 x 0.5 x (8 x 40 + 80) / 6400 = 0.5 s), would be 2.6x slower
    assert 128 / steady(r) < 0.5 / 2.5
    # a rate without its shape (public figures) is taken per computed token; an older profile's shape without
    # its group size takes the config's
    assert TrainerProfile(tokens_per_s=6400.0).forward_share() == 1.0
    assert TrainerProfile(tokens_per_s=1.0, prompt_tokens=8, completion_tokens=24).forward_share(8) == \
        pytest.approx(200 / 256)


def test_push_time_delays_gated_requests_and_pause_stops_the_server():
    # on-policy: each step waits for the push (0.02 s) and the server's pause (0.01 s) before generating
    r = simulate(flat_profile(push=0.02, pause=0.01), dataclasses.replace(BASE, max_lag=0))
    assert steady(r) == pytest.approx(128 / (0.1 + 0.03), rel=1e-6)
    assert r.server_busy[0] == pytest.approx(0.11 / 0.13, rel=0.02)  # decoding + paused, not waiting


def test_a_push_takes_longer_beside_the_work_that_runs_with_it():
    beside = {"push_beside_train_s": 0.15, "push_beside_decode_s": 1.0, "push_beside_both_s": 1.0}
    # on-policy: as a step's push starts, the trainer has nothing to train and the server nothing it may decode,
    # so the push is alone: the extras change nothing (128 samples per 0.1 s of decoding + 0.02 s of push)
    on_policy = dataclasses.replace(BASE, max_lag=0)
    r = simulate(flat_profile(push=0.02).model_copy(update=beside), on_policy)
    assert steady(r) == pytest.approx(128 / 0.12, rel=1e-6)
    # trainer-bound (0.2 s a step at 6400 tok/s, decoding 0.1 s, max_lag 4): the next step's groups are in when a
    # push starts (the trainer trains beside it) and the server has decoded all it may (idle): the push takes
    # 0.1 + 0.15 s, and each optimizer step waits for the push before it, so a step takes 0.25 s, not 0.2
    trainer_bound = dataclasses.replace(BASE, max_lag=4, steps=24)
    alone = simulate(flat_profile(tok_s=6400.0, push=0.1), trainer_bound)
    assert steady(alone, 8) == pytest.approx(128 / 0.2, rel=1e-6)
    r = simulate(flat_profile(tok_s=6400.0, push=0.1).model_copy(update=beside), trainer_bound)
    assert steady(r, 8) == pytest.approx(128 / 0.25, rel=1e-6)


def test_the_push_extra_follows_the_trainer_and_the_servers_at_its_start():
    from inflight_plan.sim import Simulator

    prof = flat_profile(push=0.01).model_copy(update={
        "push_beside_train_s": 0.002, "push_beside_decode_s": 0.003, "push_beside_both_s": 0.007})
    sim = Simulator(prof, dataclasses.replace(BASE, servers=2))
    for training, decoding, seconds in ((False, False, 0.01), (True, False, 0.012), (False, True, 0.013),
                                        (True, True, 0.017)):
        sim.trainer_busy = training
        sim.servers[1].chunk = (1, 0.0, 0.0, 0.01, 5, 8) if decoding else None  # one server of two decoding is enough
        assert sim._push_s() == pytest.approx(seconds)


def test_wake_ups_wait_for_a_core_only_where_the_other_threads_take_every_core():
    # on-policy, 16 groups end together at 0.1 s; the server's HTTP thread answers them one after another (0.5 ms
    # each) and the actor handles each in 2 ms, waking up twice: on 1 core, beside the busy HTTP thread, each
    # wake-up waits 1 ms, so the last group reaches the trainer at 0.1 + 0.0005 + 16 x (0.002 + 0.002)
    prof = flat_profile().model_copy(update={"server_s_per_group": 0.0005, "server_http_stall": 0.0,
                                             "actor_s_per_group": 0.002, "actor_wakeups_per_group": 2.0,
                                             "wakeup_wait_s": 0.001})
    on_policy = dataclasses.replace(BASE, max_lag=0)
    assert steady(simulate(prof, on_policy, cores=1)) == pytest.approx(128 / 0.1645, rel=1e-6)
    # each role on its own device (cores 0), or 2 cores for the HTTP thread alone: no wait
    assert steady(simulate(prof, on_policy)) == pytest.approx(128 / 0.1325, rel=1e-6)
    assert steady(simulate(prof, on_policy, cores=2)) == pytest.approx(128 / 0.1325, rel=1e-6)


def test_a_wake_up_waits_when_the_other_threads_fill_the_cores():
    from inflight_plan.sim import Simulator

    prof = flat_profile().model_copy(update={"wakeup_wait_s": 0.001})
    sim = Simulator(prof, dataclasses.replace(BASE, servers=2), cores=2)
    a, b = sim.servers
    assert sim._wake_wait(3.0) == 0.0  # nothing else runs
    sim.trainer_busy = True
    assert sim._wake_wait(3.0) == 0.0  # one thread on 2 cores: one is free
    a.chunk = (1, 0.0, 0.0, 0.01, 5, 8)
    assert sim._wake_wait(3.0) == pytest.approx(0.003)  # the trainer and an engine: both cores taken
    a.chunk = None
    a.http_free = 1.0  # a's HTTP thread busy: it counts for the actor and for b's HTTP thread, not for its own
    assert sim._wake_wait(3.0) == pytest.approx(0.003)
    assert sim._wake_wait(2.0, http=b) == pytest.approx(0.002)
    assert sim._wake_wait(2.0, http=a) == 0.0
    sim.actor_free = 1.0  # the actor busy too: a's HTTP thread then waits
    assert sim._wake_wait(2.0, http=a) == pytest.approx(0.002)
    assert Simulator(prof, BASE)._wake_wait(3.0) == 0.0  # roles on devices of their own (cores 0)


def test_lag_histograms():
    on_policy = simulate(flat_profile(), dataclasses.replace(BASE, max_lag=0, lengths=Lengths("uniform:1:40")))
    assert set(on_policy.lag_hist) == {0}
    sync1 = simulate(flat_profile(), dataclasses.replace(BASE, mode="sync", num_grad_steps=1))
    assert set(sync1.lag_hist) == {0}  # one optimizer step per round: the conventional on-policy loop
    sync4 = simulate(flat_profile(), dataclasses.replace(BASE, mode="sync", num_grad_steps=4))
    assert sync4.lag_share() == pytest.approx({0: 0.25, 1: 0.25, 2: 0.25, 3: 0.25})
    total = 16 * 128 * 10
    assert sum(sync4.lag_hist.values()) == total  # every completion token of every trained sample, once


@pytest.mark.parametrize("mode,update,gated,lag,servers", [
    ("pipelined", "keep", True, 0, 3), ("pipelined", "keep", True, 1, 2), ("pipelined", "interrupt", True, 2, 4),
    ("pipelined", "keep", False, 1, 2), ("pipelined", "keep", False, 0, 1), ("sync", "keep", True, 0, 2),
])
def test_staleness_bound_and_shares_hold_on_random_workloads(mode, update, gated, lag, servers):
    prof = flat_profile(tok_s=30000.0, prefill=2e5, push=0.05, pause=0.01, overhead=0.003)
    prof = prof.model_copy(update={"engine": prof.engine.model_copy(update={"decode": DecodeCurve(
        batches=[1, 16, 64], contexts=[16, 256], step_s=[[0.004, 0.005, 0.009], [0.005, 0.007, 0.014]])})})
    cfg = SimConfig(mode=mode, update_mode=update, gated=gated, max_lag=lag, servers=servers, max_batch=48,
                    group_size=4, groups_per_step=12, prompt_tokens=20, lengths=Lengths("lognormal:40:1.0:300"),
                    steps=12, seed=3, concurrency_per_server=5)
    r = simulate(prof, cfg)
    bound = cfg.num_grad_steps - 1 if mode == "sync" else lag
    assert max(r.lag_hist) <= bound and min(r.lag_hist) >= 0
    assert all(0.0 <= b <= 1.0 for b in r.server_busy) and 0.0 <= r.trainer_busy <= 1.0
    assert 0 < r.server_mean_batch <= 48
    assert r.step_end_s == sorted(r.step_end_s) and len(r.step_end_s) == cfg.steps
    assert simulate(prof, cfg).step_end_s == r.step_end_s  # seeded: the same run twice
    assert simulate(prof, dataclasses.replace(cfg, seed=4)).step_end_s != r.step_end_s


def test_interrupt_pays_for_re_prefill_only_when_prefill_costs():
    cfg = dataclasses.replace(BASE, max_lag=2, lengths=Lengths("uniform:5:60"), prompt_tokens=100)
    slow = flat_profile(tok_s=20000.0, prefill=2e4)
    keep = simulate(slow, cfg)
    interrupt = simulate(slow, dataclasses.replace(cfg, update_mode="interrupt"))
    assert interrupt.samples_per_s < keep.samples_per_s
    fast = flat_profile(tok_s=20000.0)
    assert simulate(fast, dataclasses.replace(cfg, update_mode="interrupt")).step_end_s == pytest.approx(
        simulate(fast, cfg).step_end_s)


def test_time_to_samples():
    from inflight_plan.split import time_to

    r = simulate(flat_profile(), BASE)
    assert r.time_to_samples(128) == pytest.approx(0.1)
    assert r.time_to_samples(129) == pytest.approx(0.2)
    assert r.time_to_samples(10**9) is None
    assert time_to(r, 128 * 16 + 1280) == pytest.approx(1.6 + 1.0)  # beyond the run: at the steady 1280 samples/s


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        SimConfig(mode="async")
    with pytest.raises(ValueError):
        SimConfig(max_lag=-1)
    with pytest.raises(ValueError):
        Lengths("gamma:3")
    with pytest.raises(ValueError):
        Lengths(values=[0, 3])


def test_a_groups_requests_are_parsed_on_the_servers_http_thread():
    # one round of 16 groups x 8 = one full batch of 128, 10 decode steps of 10 ms, everything else free; the 16
    # requests (1.5 ms each) are parsed one after another on the HTTP thread: group k joins the queue at 1.5 (k + 1)
    # ms. The engine starts on group 0 at 1.5 ms; a group that arrives mid-step joins at the next boundary (11.5,
    # 21.5, 31.5 ms): the last one (24 ms) at 31.5 ms, then its 10 steps
    cfg = dataclasses.replace(BASE, mode="sync", num_grad_steps=1, steps=1, gated=False)
    beside = flat_profile().model_copy(update={"server_s_per_request": 0.0015, "server_http_stall": 0.0})
    r = simulate(beside, cfg)
    assert r.step_end_s == [pytest.approx(0.1315)]
    assert r.server_busy[0] == pytest.approx(0.13 / 0.1315)  # decoding from 1.5 ms on
    # the interpreter lock held throughout (stall 1): the parses that ran while the engine decoded are taken from it
    # at the next boundary: 6 x 1.5 ms at 11.5 ms (3-10.5 ms), none of those parsed during that stall, 3 x 1.5 ms at
    # 30.5 ms (21-24 ms): the last groups join at 35 ms
    stalled = simulate(beside.model_copy(update={"server_http_stall": 1.0}), cfg)
    assert stalled.step_end_s == [pytest.approx(0.135)]
    # the HTTP thread is a busy thread of its own for the cores (contention.py): 24 ms of parsing, 22.5 of them
    # beside the decoding engine
    occ = simulate(beside, cfg, occupancy=True).extra["occupancy"]
    assert sum(dt for (_, _, _, h, _), dt in occ.items() if h) == pytest.approx(0.024)
    assert sum(dt for (_, e, _, h, _), dt in occ.items() if h and e) == pytest.approx(0.0225)
    # stalled, the engine is recorded apart (it wants a core only for Profile.server_http_spin of that time): here
    # the 9 + 4.5 ms it paid at 11.5 and 30.5 ms
    occ = simulate(beside.model_copy(update={"server_http_stall": 1.0}), cfg, occupancy=True).extra["occupancy"]
    assert sum(dt for (_, _, s, _, _), dt in occ.items() if s) == pytest.approx(0.0135)
