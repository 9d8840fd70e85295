"""`--resume` under `pipeline.launcher=ray`: the trainer's Ray actor process is SIGKILLed after a checkpoint and a
later step; the launcher stops the run naming the trainer; `inflight train --resume` continues on the same Ray
cluster (the Redis stream of the dead run is started afresh, as the local launcher does) and the run ends at the
same step count with the step, sample, group (prompt) and version counters lining up exactly, the staleness bound
held on every step, the first one after the resume included (the local-launcher version:
tests/reliability/test_resume_pipeline.py)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from inflight.config.actor import ActorConfig
from tests.reliability.pipeline_helpers import base_overrides, kill_group, latest_step, launch, ports, records, wait_for

pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS, GPS, G, MAX_LAG, KEY = 30, 2, 4, 1, "ray-test-key"  # steps take 0.05-0.5 s: the kill lands mid-run


def test_ray_trainer_killed_then_resume(tiny_model_dir, tmp_path, ray_cluster, redis_url):
    ray_cluster.wait_nodes({"node_a", "node_b"})  # another test of the module may have restarted node_b
    run = tmp_path / "runs" / "rayresume"
    ray_args = ["pipeline.launcher=ray", f"pipeline.ray_address={ray_cluster.address}", "pipeline.stream=redis",
                f"pipeline.redis_url={redis_url}", f"server.api_key={KEY}",
                "pipeline.ray_resources={server0: node_a, server1: node_b, trainer: node_a, actor: node_b}"]
    args = base_overrides(tiny_model_dir, tmp_path / "runs", "rayresume", *ray_args, f"pipeline.max_steps={STEPS}",
                          "pipeline.checkpoint_every=2", "pipeline.keep_checkpoints=2")

    # 1. SIGKILL the trainer's actor process once a checkpoint exists and a later step was trained
    p = launch(["/dev/null", *args])
    try:
        wait_for(lambda: latest_step(run) >= 3 and records(run, "checkpoint"), p, 150, "step 3 and a checkpoint")
        os.kill(records(run, "trainer_ready")[0]["pid"], signal.SIGKILL)
        _, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            kill_group(p.pid)
            p.wait(timeout=30)
    assert p.returncode == 1 and "role 'trainer' stopped unexpectedly" in err, err[-3000:]
    ckpt = max(r["step"] for r in records(run, "checkpoint"))
    trained_before_kill = latest_step(run)

    # 2. resume on the same cluster, to the end
    p = launch(["--resume", str(run), *ray_args, *ports()])
    try:
        _, err = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            kill_group(p.pid)
            p.wait(timeout=30)
    assert p.returncode == 0, err[-3000:]

    starts = records(run, "run_start")
    assert [(s["launcher"], s["resumed_step"]) for s in starts] == [("ray", None), ("ray", ckpt)]
    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["samples_total"] for r in steps] == [G * GPS * s for s in range(1, STEPS + 1)]
    # every prompt (group index) trained exactly once, in order: none repeated, none lost across the resume
    assert [r["group_indices"] for r in steps] == [[GPS * (s - 1) + j for j in range(GPS)] for s in range(1, STEPS + 1)]
    assert all(0 <= r["lag_min"] and r["lag_max"] <= MAX_LAG for r in steps), [(r["step"], r["lag_max"]) for r in steps]
    after = steps[ckpt]  # the first step trained after the resume: samples of the checkpoint's weights or newer
    assert min(int(v) for v in after["start_versions"]) >= ckpt
    # every push, the one right after the resume too, reached both servers (a push is logged once all answered)
    assert [r["step"] for r in records(run, "weight_push")] == list(range(1, STEPS + 1))
    ready = records(run, "trainer_ready")
    assert [r["step"] for r in ready] == [0, ckpt]
    rolled = records(run, "train_step", name="metrics.rolled_back.jsonl")
    assert {r["step"] for r in rolled} >= set(range(ckpt + 1, trained_before_kill + 1))
    # the resumed run trained only groups of its own actor: the dead run's un-trained groups left the stream
    from inflight.streams.redis_stream import RedisStream

    stream = RedisStream(redis_url, name="rayresume")
    try:
        ahead = ActorConfig().queue_ahead  # queued-ahead groups are produced too
        assert stream.produced <= (STEPS + MAX_LAG + 1 + ahead - ckpt) * GPS, (stream.produced, ckpt)
    finally:
        stream.close()
    final = json.loads((run / "checkpoints" / "final" / "state.json").read_text())
    assert (final["step"], final["samples_trained"], final["next_group"], final["skipped_groups"]) == (
        STEPS, STEPS * GPS * G, STEPS * GPS, [])
