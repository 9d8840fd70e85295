"""`pipeline.launcher=ray` with `trainer.backend=fsdp2` at one rank: the rank's actor gets RANK / WORLD_SIZE /
MASTER_* as at several ranks (FSDP2 forms its process group at any world size), and the run trains to the end."""

from __future__ import annotations

import pytest

from tests.reliability.pipeline_helpers import base_overrides, kill_group, launch, records

pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_ray_fsdp2_one_rank(tiny_model_dir, tmp_path, ray_cluster, redis_url):
    run = tmp_path / "runs" / "rayfsdp1"
    args = base_overrides(
        tiny_model_dir, tmp_path / "runs", "rayfsdp1", "pipeline.launcher=ray",
        f"pipeline.ray_address={ray_cluster.address}", "pipeline.stream=redis", f"pipeline.redis_url={redis_url}",
        "server.api_key=ray-test-key", "server.num_servers=1", "trainer.backend=fsdp2", "trainer.num_processes=1",
        "pipeline.max_steps=2", "pipeline.ray_resources={server0: node_a, trainer: node_a, actor: node_b}")
    p = launch(["/dev/null", *args])
    try:
        _, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            kill_group(p.pid)
            p.wait(timeout=30)
    assert p.returncode == 0, err[-3000:]
    assert [r["step"] for r in records(run, "train_step")] == [1, 2]
    assert [r["ranks"] for r in records(run, "train_step")] == [1, 1]  # the distributed loop, at one rank
