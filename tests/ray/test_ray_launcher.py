"""`pipeline.launcher=ray` on a two-node Ray cluster on this machine: the servers, the trainer and the actor are
pinned to nodes by custom resources (trainer + server0 + actor on node_a, server1 on node_b); the tiny-model
pipelined run completes, every server gets every weight version, the lag stays within max_lag. Mid-run node_b is
killed (SIGKILL of its raylet's process group): the actor routes around server1, the trainer's weight update waits
for it, Ray restarts server1 when node_b comes back, and it serves again only with the current weights."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from inflight.trainer.weight_sync.rejoin import refused
from tests.reliability.pipeline_helpers import base_overrides, kill_group, latest_step, launch, records, wait_for

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

STEPS, MAX_LAG, KEY = 40, 1, "ray-test-key"


@pytest.mark.timeout(420)
def test_ray_two_nodes_with_node_loss(tiny_model_dir, tmp_path, ray_cluster, redis_url):
    run = tmp_path / "runs" / "ray2"
    args = base_overrides(
        tiny_model_dir, tmp_path / "runs", "ray2", "pipeline.launcher=ray",
        f"pipeline.ray_address={ray_cluster.address}", "pipeline.stream=redis", f"pipeline.redis_url={redis_url}",
        f"server.api_key={KEY}",
        "pipeline.restart_servers=true", f"pipeline.max_steps={STEPS}", f"actor.max_lag={MAX_LAG}",
        "pipeline.ray_resources={server0: node_a, server1: node_b, trainer: node_a, actor: node_a}")
    p = launch(["/dev/null", *args])
    try:
        wait_for(lambda: records(run, "roles_started"), p, 150, "roles started")
        started = records(run, "roles_started")[0]
        nodes = ray_cluster.node_resources()
        where = {role: nodes[nid] for role, nid in started["ray_nodes"].items()}
        assert "node_a" in where["trainer"] and "node_a" in where["server0"] and "node_a" in where["actor"]
        assert "node_b" in where["server1"] and "node_a" not in where["server1"]
        url1 = started["servers"][1]
        assert not url1.startswith("http://127."), "servers bind the node IP Ray reports"
        # the admin endpoints are reachable from other hosts, so they need the key
        assert httpx.post(url1 + "/request_weight_update", json={}, timeout=5).status_code == 401

        wait_for(lambda: latest_step(run) >= 2, p, 120, "two trainer steps")
        # a step takes well under 0.1 s here: hold the trainer while node_b dies, so the loss lands mid-run
        trainer_pid = records(run, "trainer_ready")[0]["pid"]
        os.kill(trainer_pid, signal.SIGSTOP)
        try:
            killed_at = latest_step(run)
            assert killed_at < STEPS
            ray_cluster.kill_node("node_b")
            wait_for(lambda: refused(url1), p, 30, "server1 gone with node_b")
        finally:
            os.kill(trainer_pid, signal.SIGCONT)
        ray_cluster.start_node("node_b")
        wait_for(lambda: records(run, "server_restart"), p, 120, "server1 restarted by Ray")
        _, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            kill_group(p.pid)
            p.wait(timeout=30)
    assert p.returncode == 0, err[-3000:]

    restart = records(run, "server_restart")
    assert [r["server"] for r in restart] == [1]
    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(0 <= r["lag_min"] and r["lag_max"] <= MAX_LAG for r in steps)  # staleness bound held throughout
    # every push reached every server, server1 too (a push is logged once all answered)
    assert [r["step"] for r in records(run, "weight_push")] == list(range(1, STEPS + 1))
    for k in (0, 1):
        versions = [r["weight_version"] for r in records(run, "server_metrics") if r["server"] == k]
        assert versions and versions[-1] == STEPS and len(set(versions)) >= 2
    # the trainer's weight update waited for the lost server and formed the group again with it
    assert records(run, "weight_sync_retry")


@pytest.mark.timeout(300)
def test_ray_trainer_death_stops_the_run(tiny_model_dir, tmp_path, ray_cluster, redis_url):
    """A two-rank FSDP2 trainer placed by a placement group on node_b; SIGKILL of rank 0's process: the launcher
    stops the run (exit 1), names the trainer and its log, and takes every role down (the servers' ports close)."""
    import os
    import signal

    ray_cluster.wait_nodes({"node_a", "node_b"})
    run = tmp_path / "runs" / "raydeath"
    args = base_overrides(
        tiny_model_dir, tmp_path / "runs", "raydeath", "pipeline.launcher=ray",
        f"pipeline.ray_address={ray_cluster.address}", "pipeline.stream=redis", f"pipeline.redis_url={redis_url}",
        f"server.api_key={KEY}", "pipeline.max_steps=100000", "trainer.backend=fsdp2", "trainer.num_processes=2",
        "pipeline.ray_resources={server0: node_a, server1: node_b, trainer: node_b, actor: node_a}")
    p = launch(["/dev/null", *args])
    try:
        wait_for(lambda: latest_step(run) >= 1, p, 150, "a trainer step")
        started = records(run, "roles_started")[0]
        nodes = ray_cluster.node_resources()
        assert all("node_b" in nodes[started["ray_nodes"][r]] for r in ("trainer", "trainer-rank1"))
        os.kill(records(run, "trainer_ready")[0]["pid"], signal.SIGKILL)
        _, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            kill_group(p.pid)
            p.wait(timeout=30)
    assert p.returncode == 1, err[-3000:]
    assert "role 'trainer' stopped unexpectedly" in err and "logs/trainer.log" in err
    failed = records(run, "role_failed")
    assert [r["failed_role"] for r in failed] == ["trainer"]
    assert all(refused(u) for u in started["servers"])  # the launcher stopped the servers on both nodes


@pytest.mark.timeout(60)
def test_unplaceable_role_fails_naming_resources(ray_cluster):
    """A role Ray cannot place (a resource no node has, more CPUs than a node has) fails within the timeout with
    what it asked for and what the cluster has, instead of waiting forever; a placeable one answers."""
    import ray

    from inflight.pipeline.ray.cluster import placed
    from inflight.pipeline.ray.roles import RoleActor
    from inflight.pipeline.supervise import RoleFailed

    ray.init(address=ray_cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        fits = ray.remote(RoleActor).options(num_cpus=1, resources={"node_b": 0.001}).remote("fits", "/tmp")
        lost = ray.remote(RoleActor).options(num_cpus=1, resources={"node_c": 0.001}).remote("lost", "/tmp")
        big = ray.remote(RoleActor).options(num_cpus=64).remote("big", "/tmp")
        got = placed({"fits": fits.node_id.remote()}, 30, {"fits": {"CPU": 1, "node_b": 0.001}})
        assert got["fits"] in {n["NodeID"] for n in ray.nodes() if n["Alive"] and "node_b" in n["Resources"]}
        with pytest.raises(RoleFailed) as err:
            placed({"actor": lost.node_id.remote(), "server0": big.node_id.remote()}, 2,
                   {"actor": {"CPU": 1, "node_c": 0.001}, "server0": {"CPU": 64}})
        msg = str(err.value)
        assert "'actor' asks for {CPU: 1, node_c: 0.001}" in msg and "'server0' asks for {CPU: 64}" in msg
        assert "The cluster has {CPU: 8," in msg and "node_a: 1" in msg and "node_b: 1" in msg
        assert "can never hold 'actor', 'server0'" in msg and "pipeline.startup_timeout_s" in msg
        for a in (fits, lost, big):
            ray.kill(a)
    finally:
        ray.shutdown()
