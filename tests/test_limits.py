"""The staleness bound, from one place (inflight/config/limits.py): the values every role applies, computed by hand
for a few configs, and the actor, trainer loop, launcher and plan simulator all getting the same ones. Sync mode
derives its bound (num_grad_steps - 1) and leaves the user's actor.max_lag in the config."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import yaml

from inflight.config import RunConfig, load_config
from inflight.config.limits import Staleness, effective_max_lag, staleness

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def cfg_of(*overrides: str) -> RunConfig:
    return load_config(RunConfig, overrides=list(overrides))


def test_pipelined_gated_without_queue_ahead():
    cfg = cfg_of("actor.max_lag=2", "actor.groups_per_step=4", "actor.queue_ahead=0")
    b = staleness(cfg)
    assert b == Staleness(max_lag=2, groups_per_step=4, gated=True, queue_ahead=0)
    assert [b.groups_allowed(v) for v in (-5, -1, 0, 5)] == [0, 8, 12, 32]  # (v + 2 + 1) x 4, never below 0
    assert [b.min_version(v) for v in (0, 1, 2, 5)] == [0, 0, 0, 3]  # v - 2, never below 0
    # group k is trained on the weights of version k // 4: its requests carry min_version of that
    assert [b.request_min_version(k) for k in (0, 7, 12, 13, 23)] == [0, 0, 1, 1, 3]
    assert b.stream_capacity == 32  # 2 x (2 + 2) x 4
    assert b.adapters_kept == 4  # 2 + 2


def test_queue_ahead_counts_only_with_the_gate():
    gated = staleness(cfg_of("actor.max_lag=1", "actor.groups_per_step=3", "actor.queue_ahead=2"))
    assert gated.groups_allowed(0) == 12 and gated.groups_allowed(4) == 24  # (v + 1 + 1 + 2) x 3
    assert gated.min_version(4) == 3 and gated.request_min_version(14) == 3  # queue_ahead moves no version bound
    assert gated.stream_capacity == 18 and gated.adapters_kept == 3  # 2 x (1 + 2) x 3; 1 + 2
    for off in ("actor.version_gate=false", "actor.adapter=vllm"):  # no server holds the requests: none sent early
        b = staleness(cfg_of("actor.max_lag=1", "actor.groups_per_step=3", "actor.queue_ahead=2", off))
        assert not b.gated and b.groups_allowed(0) == 6 and b.groups_allowed(4) == 18  # (v + 1 + 1) x 3
        assert b.request_min_version(14) == 0  # nothing to hold it for


def test_sync_derives_its_bound_and_keeps_the_users_value():
    cfg = cfg_of("pipeline.mode=sync", "pipeline.num_grad_steps=3", "actor.max_lag=1", "actor.groups_per_step=2")
    b = staleness(cfg)
    assert b.max_lag == 2  # num_grad_steps - 1
    assert cfg.actor.max_lag == 1  # asked, not written
    assert b.groups_allowed(0) == 8 and b.groups_allowed(3) == 14  # (v + 2 + 1 + queue_ahead 1) x 2
    assert b.min_version(3) == 1 and b.request_min_version(7) == 1  # 7 // 2 = 3, minus 2
    assert b.stream_capacity == 16 and b.adapters_kept == 4  # 2 x (2 + 2) x 2; 2 + 2
    # one step per round: on-policy, whatever max_lag says; pipelined: max_lag itself
    assert staleness(cfg_of("pipeline.mode=sync", "pipeline.num_grad_steps=1", "actor.max_lag=4")).max_lag == 0
    assert effective_max_lag(4, "sync", 5) == 4 and effective_max_lag(4, "pipelined", 5) == 4
    assert effective_max_lag(0, "sync", 4) == 3 and effective_max_lag(3) == 3


def test_lora_adapters_kept_by_the_adapter_client(tmp_path):
    """Stock vLLM serves one adapter per version: the client keeps the last adapters_kept (effective max_lag + 2)."""
    from inflight.trainer.weight_sync.vllm import vllm_lora_client

    lora = ["trainer.protocol=vllm", "trainer.lora.rank=8", "actor.adapter=vllm", f"pipeline.run_dir={tmp_path}",
            "model.path=/nonexistent"]
    for extra, kept in ((["actor.max_lag=2"], 4), (["actor.max_lag=0", "pipeline.mode=sync",
                                                    "pipeline.num_grad_steps=4"], 5)):
        cfg = cfg_of(*lora, *extra)
        assert staleness(cfg).adapters_kept == kept
        client = vllm_lora_client(cfg, URLS)
        try:
            assert client.keep == kept
        finally:
            client.close()
        assert cfg.actor.max_lag == int(extra[0].split("=")[1])


SYNC = ("pipeline.mode=sync", "pipeline.num_grad_steps=3", "actor.max_lag=1", "actor.groups_per_step=2",
        "actor.group_size=2", "actor.queue_ahead=1", "pipeline.max_steps=6")


def test_trainer_loop_caps_at_the_actors_bound():
    """live_cap: every group the actor may have started (queued-ahead ones included), up to the run's limit."""
    from inflight.trainer.loop.trainer_loop import TrainerLoop

    cfg = cfg_of(*SYNC)  # limit: 6 steps x 2 groups = 12
    caps = [TrainerLoop.live_cap(SimpleNamespace(cfg=cfg, published_version=v)) for v in (0, 1, 3)]
    assert caps == [8, 10, 12]  # (v + 2 + 1 + 1) x 2 = 8, 10, 14 -> the limit 12
    assert caps[:2] == [staleness(cfg).groups_allowed(v) for v in (0, 1)]
    pipelined = cfg_of("actor.max_lag=1", "actor.groups_per_step=2", "actor.queue_ahead=1", "actor.adapter=vllm")
    assert TrainerLoop.live_cap(SimpleNamespace(cfg=pipelined, published_version=2)) == 8


def test_actor_gets_the_runs_bound():
    from inflight.actor.run import open_actor
    from inflight.streams.memory import MemoryStream

    cfg = cfg_of(*SYNC)

    async def main() -> tuple[list[int], list[int]]:
        async with open_actor(cfg, URLS, MemoryStream(capacity=16), rewards=object()) as actor:
            return [actor.bound(v) for v in (-1, 0, 3)], [actor.oldest_version(k) for k in (5, 6, 9)]

    bounds, oldest = asyncio.run(main())
    assert bounds == [6, 8, 14]  # (v + 2 + 1 + 1) x 2
    assert oldest == [0, 1, 2]  # k // 2 - 2
    assert cfg.actor.max_lag == 1


def test_simulator_gets_the_runs_bound():
    from inflight_plan.profile import DecodeCurve, EngineProfile, Profile, TrainerProfile
    from inflight_plan.sim import Simulator
    from inflight_plan.workload import Lengths, SimConfig, from_run_config

    cfg = cfg_of(*SYNC)
    sim_cfg = from_run_config(cfg, Lengths("fixed:4"), steps=6)
    assert sim_cfg.max_lag == 1  # the user's value, as in the run's config
    assert sim_cfg.staleness == staleness(cfg) == Staleness(max_lag=2, groups_per_step=2, gated=True, queue_ahead=1)
    profile = Profile(source="test", engine=EngineProfile(decode=DecodeCurve(batches=[1, 8], contexts=[1],
                                                                             step_s=[[0.01, 0.01]]),
                                                          prefill_tokens_per_s=1e9, max_batch=8),
                      trainer=TrainerProfile(tokens_per_s=1e9))
    sim = Simulator(profile, sim_cfg)
    assert sim._allowed() == 8  # the actor's bound at version 0 (of 12 groups in all)
    sim.run()
    assert max(sim.lag) == 2  # sync rounds of 3: lag 0, 1, 2
    pipelined = SimConfig(max_lag=2, groups_per_step=4, queue_ahead=0)
    assert pipelined.staleness == staleness(cfg_of("actor.max_lag=2", "actor.groups_per_step=4",
                                                   "actor.queue_ahead=0"))


def test_launcher_keeps_the_users_value_and_sizes_the_stream(tiny_model_dir, tmp_path, monkeypatch):
    """The local launcher: the resolved config it saves keeps actor.max_lag; the stream gets staleness's capacity."""
    from inflight.pipeline import local_launcher

    class Stop(Exception):
        pass

    asked: dict[str, int] = {}

    def make_stream(pipeline_cfg, *, name="inflight", capacity=1024, ctx=None):
        asked["capacity"] = capacity
        raise Stop  # nothing started yet

    monkeypatch.setattr(local_launcher, "make_stream", make_stream)
    cfg = cfg_of(*SYNC, f"model.path={tiny_model_dir}", f"pipeline.run_dir={tmp_path}", "name=r")
    with pytest.raises(Stop):
        local_launcher.run_pipeline_local(cfg)
    assert asked["capacity"] == staleness(cfg).stream_capacity == 16  # 2 x (2 + 2) x 2
    assert cfg.actor.max_lag == 1
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["actor"]["max_lag"] == 1


def test_oversubscription_warning_counts_syncs_bound(caplog):
    """The launcher's warning caps the sequences in flight by the run's bound: sync with 1 step a round keeps
    (0 + 0 + 1 + 1) x 64 x 8 = 1024 in flight, what 4 servers of 256 decode at once; actor.max_lag=4 would be 3072."""
    from inflight.pipeline.launch_common import warn_oversubscribed

    over = ["server.num_servers=4", "server.max_batch=256", "actor.group_size=8", "actor.groups_per_step=64",
            "actor.max_lag=4", "actor.concurrency_per_server=128", "actor.max_new_tokens=1024"]
    with caplog.at_level("WARNING", logger="inflight.pipeline.launch_common"):
        warn_oversubscribed(cfg_of(*over, "pipeline.mode=sync", "pipeline.num_grad_steps=1"))
        assert not caplog.records
        warn_oversubscribed(cfg_of(*over))
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "up to 3072 sequences in flight" in msg
