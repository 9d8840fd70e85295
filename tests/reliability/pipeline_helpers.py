"""Helpers of the pipeline-level fault tests: free ports (the one port helper of the test suite), a launcher
subprocess, metrics records."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# Test servers listen below the kernel's ephemeral range (Linux: 32768-60999), so that no outgoing connection can
# take their port between the check and the bind (seen: a Ray node's connections took server1's port, EADDRINUSE),
# and above Ray's worker ports (10002-19999 by default).
_PORTS = range(20000, 32700)
_rng = random.Random()  # seeded from os.urandom: tests of concurrent sessions do not walk the same sequence


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # every interface: servers on a Ray node bind that node's own address
            return True
        except OSError:
            return False


def free_base_port(n: int) -> int:
    """A port p with p .. p + n - 1 free."""
    for _ in range(200):
        base = _rng.randrange(_PORTS.start, _PORTS.stop - n)
        if all(_is_free(base + k) for k in range(n)):
            return base
    raise RuntimeError("no free ports")


def free_port() -> int:
    return free_base_port(1)


def ports() -> list[str]:
    """Fresh ports for every launch (a resumed run may not find the old ones free yet)."""
    return [f"server.base_port={free_base_port(2)}", f"pipeline.weight_sync_port={free_port()}"]


def base_overrides(model_dir: Path, run_dir: Path, name: str, *extra: str) -> list[str]:
    return [
        f"model.path={model_dir}", f"name={name}", f"pipeline.run_dir={run_dir}", "server.num_servers=2",
        "server.threads=1", "server.max_batch=64", "trainer.threads=1", "pipeline.progress=false",
        "pipeline.tensorboard=false", "task.eval_size=16", "actor.eval_every=0", "actor.group_size=4",
        "actor.groups_per_step=2", "actor.max_new_tokens=24", "actor.max_lag=1", "actor.retries=8",
        "actor.probe_interval_s=0.2", *ports(), *extra,
    ]


def launch(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "inflight.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def records(run: Path, event: str | None = None, name: str = "metrics.jsonl") -> list[dict]:
    path = run / name
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if event is None or r["event"] == event:
            out.append(r)
    return out


def wait_for(cond, proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited ({proc.returncode}) before {what}:\n{proc.communicate()[1][-3000:]}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.2)


def latest_step(run: Path) -> int:
    return max((r["step"] for r in records(run, "train_step")), default=0)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def dies_within(pid: int, timeout_s: float = 10.0) -> bool:
    """True once `pid` is gone or a zombie: a SIGKILLed process can take a moment to finish exiting."""
    deadline = time.time() + timeout_s
    while alive(pid):
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False
