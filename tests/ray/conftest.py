"""A two-node Ray cluster on this machine (`ray start --head` + `ray start --address`, each with its own custom
resource, node_a / node_b) and a redis-server, for the multi-host launcher tests. Every process is stopped at
teardown: the `ray start --block` groups are killed, then `ray stop` runs, then the test checks nothing is left.

Auth is explicit (docs/multi-host.md): token auth with this cluster's own token file (RAY_AUTH_MODE=token,
RAY_AUTH_TOKEN_PATH) for the nodes, the test's driver and the `inflight train` it launches, under a temporary HOME
whose ~/.ray/auth_token holds a stale token, as an earlier Ray run leaves it: the cluster must not depend on it."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inflight.pipeline.ray.cluster import set_ray_auth
from tests.reliability.pipeline_helpers import free_port

RAY = str(Path(sys.executable).with_name("ray"))
TOKEN = secrets.token_hex(16)  # one per session: a driver process keeps the first token it read


def ray_processes() -> list[str]:
    """Command lines of Ray's daemons still running on this machine."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except OSError:
            continue
        if state != "Z" and any(d in cmd for d in ("/raylet ", "gcs_server", "ray::")):
            out.append(f"{pid}: {cmd[:150]}")
    return out


class RayCluster:
    def __init__(self, log_dir: Path):
        import ray

        self.log_dir = log_dir
        self.port = free_port()
        self.ip = ray.util.get_node_ip_address()
        self.address = f"{self.ip}:{self.port}"
        self.nodes: dict[str, subprocess.Popen] = {}

    def start_node(self, resource: str, head: bool = False) -> None:
        where = ["--head", "--port", str(self.port)] if head else ["--address", self.address]
        argv = [RAY, "start", *where, "--num-cpus", "4", "--resources", json.dumps({resource: 1}),
                "--disable-usage-stats", "--block", *(["--include-dashboard=false"] if head else [])]
        log = open(self.log_dir / f"ray-{resource}.log", "ab")
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
               # notice a lost node within ~2 s (default ~30 s), so Ray restarts its actors while the test waits
               "RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
               "RAY_health_check_failure_threshold": "3"}
        self.nodes[resource] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                start_new_session=True)

    def wait_nodes(self, resources: set[str], timeout_s: float = 90) -> None:
        """Until the cluster has a live node with each custom resource."""
        import ray

        deadline = time.time() + timeout_s
        while True:
            try:
                have = {r for res in self.node_resources().values() for r in res}
                if resources <= have:
                    return
            except Exception:
                ray.shutdown()
            if time.time() > deadline:
                raise AssertionError(f"Ray nodes {resources} not up after {timeout_s} s: see {self.log_dir}")
            time.sleep(1.0)

    def node_resources(self) -> dict[str, set[str]]:
        """{Ray node id: its resource names} of the live nodes."""
        import ray

        ray.init(address=self.address, logging_level="ERROR", log_to_driver=False)
        try:
            return {n["NodeID"]: set(n["Resources"]) for n in ray.nodes() if n["Alive"]}
        finally:
            ray.shutdown()

    def kill_node(self, resource: str) -> None:
        proc = self.nodes.pop(resource)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)

    def stop(self) -> None:
        for resource in list(self.nodes):
            proc = self.nodes.pop(resource)
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=5)  # a node drains for up to 30 s on SIGTERM; nothing here needs draining
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        subprocess.run([RAY, "stop"], capture_output=True, timeout=60)


def explicit_token_auth(root: Path) -> dict[str, str | None]:
    """Set HOME (with a stale ~/.ray/auth_token), RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH (a fresh token) in
    this process's environment, which the nodes and every driver inherit; returns the old values."""
    home, token = root / "home", root / "cluster_token"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(16))  # stale: another cluster's
    token.write_text(TOKEN)
    new = {"HOME": str(home), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_AUTH_TOKEN": None}
    old = {k: os.environ.get(k) for k in new}
    set_ray_auth(new)  # ray is imported already (collection): its cached mode and token are refreshed
    return old


_shared: dict = {}  # the folder's one cluster and the environment to restore after it
HERE = Path(__file__).parent


@pytest.fixture
def ray_cluster(tmp_path_factory):
    """One cluster for all the tests of this folder (a start and a stop take ~15-30 s on 2 shared cores): started by
    the first test that asks, stopped after the folder's last test (pytest_runtest_teardown below), so its daemons
    do not take CPU from the tests that follow. A test that needs both nodes waits for them (wait_nodes): an
    earlier test may have killed and restarted node_b."""
    if "cluster" not in _shared:
        _shared["old_env"] = explicit_token_auth(tmp_path_factory.mktemp("auth"))
        _shared["cluster"] = cluster = RayCluster(tmp_path_factory.mktemp("ray"))
        try:
            cluster.start_node("node_a", head=True)
            cluster.wait_nodes({"node_a"})
            cluster.start_node("node_b")
            cluster.wait_nodes({"node_a", "node_b"})
        except BaseException:
            stop_shared_cluster()
            raise
    return _shared["cluster"]


def stop_shared_cluster() -> None:
    cluster, old_env = _shared.pop("cluster"), _shared.pop("old_env")
    cluster.stop()
    deadline = time.time() + 20
    while ray_processes() and time.time() < deadline:
        time.sleep(0.5)
    set_ray_auth(old_env)
    left = ray_processes()
    assert not left, "Ray processes left after teardown:\n" + "\n".join(left)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the folder's last test (in any selection or order): stop the cluster; a process left is an error."""
    if "cluster" in _shared and (nextitem is None or nextitem.path.parent != HERE):
        stop_shared_cluster()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("redis")
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server not found: install it with `apt-get update && apt-get install -y redis-server`")
    import redis

    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path), "--save", "",
                             "--appendonly", "no", "--loglevel", "warning"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.time() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    client.close()
    yield url
    proc.terminate()
    proc.wait(timeout=10)



def pytest_sessionfinish(session, exitstatus):
    """An interrupted session (Ctrl-C, -x) still stops the cluster."""
    if "cluster" in _shared:
        stop_shared_cluster()
