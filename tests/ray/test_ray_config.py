"""The Ray launcher's configuration checks: they fail before anything starts, with a message that says what to
set (no Ray cluster needed)."""

from __future__ import annotations

import os

import pytest

from inflight.config import RunConfig, load_config
from inflight.pipeline.ray.launcher import check_ray_config


def cfg(*overrides: str) -> RunConfig:
    return load_config(RunConfig, None, ["pipeline.launcher=ray", "pipeline.stream=redis", "server.api_key=k",
                                         "server.num_servers=2", *overrides])


def test_valid_config_returns_the_key(monkeypatch):
    monkeypatch.delenv("INFLIGHT_API_KEY", raising=False)
    assert check_ray_config(cfg("pipeline.ray_resources={server1: node_b, trainer: 'node:10.0.0.1'}")) == "k"
    monkeypatch.setenv("INFLIGHT_API_KEY", "from-env")
    assert check_ray_config(cfg("server.api_key=''")) == "from-env"


@pytest.mark.parametrize("override, message", [
    ("pipeline.stream=memory", "needs pipeline.stream=redis"),
    ("server.api_key=''", "needs an API key"),
    ("pipeline.server_urls=[http://x:1]", "leave pipeline.server_urls empty"),
    ("pipeline.ray_resources={server2: node_b}", "unknown roles ['server2']"),
    ("server.engine=vllm", "server.engine=builtin only"),
])
def test_bad_config_is_refused(monkeypatch, override, message):
    monkeypatch.delenv("INFLIGHT_API_KEY", raising=False)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_ray_config(cfg(override))


def test_unknown_launcher_is_refused():
    from inflight.pipeline.launcher import run_pipeline

    with pytest.raises(ValueError, match="pipeline.launcher must be 'local' or 'ray'"):
        run_pipeline(cfg("pipeline.launcher=slurm"))


def test_local_cluster_fits_its_roles():
    """The single-node cluster a run starts has logical CPUs for every role at once (servers, every trainer rank,
    the actor), never fewer than the machine's cores."""
    from inflight.pipeline.ray.cluster import local_cluster_cpus, role_cpus

    c = cfg("server.threads=3", "trainer.threads=2", "trainer.backend=fsdp2", "trainer.num_processes=2")
    assert role_cpus(c) == {"server0": 3, "server1": 3, "trainer": 2, "trainer-rank1": 2, "actor": 1}
    assert local_cluster_cpus(c) == max(11, os.cpu_count())
    one = cfg("server.num_servers=1", "server.threads=1", "trainer.threads=1")
    assert sum(role_cpus(one).values()) == 3  # server + trainer + actor: Ray's default of 2 CPUs here hangs
    assert local_cluster_cpus(one) >= 3


OWN_CLUSTER = """
import json, sys
import ray
from inflight.config import RunConfig, load_config
from inflight.pipeline.ray.cluster import connect
cfg = load_config(RunConfig, None, ["pipeline.launcher=ray", "server.threads=2", "trainer.threads=2"])
connect(cfg)
try:
    cpus = ray.cluster_resources()["CPU"]
    answer = ray.get(ray.remote(lambda: 42).options(num_cpus=2).remote(), timeout=60)
    from ray._raylet import AuthenticationMode, get_authentication_mode
    token_auth = get_authentication_mode() == AuthenticationMode.TOKEN
finally:
    ray.shutdown()
print(json.dumps({"cpus": cpus, "answer": answer, "token_auth": token_auth}))
"""


@pytest.mark.slow  # starts a one-node Ray (~10-20 s here)
@pytest.mark.timeout(120)
def test_own_cluster_fits_roles_and_leaves_no_token(tmp_path):
    """With no ray_address the run starts its own Ray: token auth with a per-run token from the environment, so it
    writes no ~/.ray/auth_token (Ray's default for a new cluster does, and that file then changes what the next
    `ray start --head` on this host expects); its CPUs fit the roles."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", OWN_CLUSTER], env=env, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["answer"] == 42 and got["cpus"] >= 2 + 2 + 1  # server + trainer + actor, whatever the cores
    assert got["token_auth"]
    assert not (home / ".ray" / "auth_token").exists()
