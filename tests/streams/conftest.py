"""Fixtures of the stream tests: a real redis-server on a free port in a temp dir, stopped afterwards."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from tests.reliability.pipeline_helpers import free_port


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server not found: install it with `apt-get update && apt-get install -y redis-server`")
    import redis

    port, workdir = free_port(), tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "", "--appendonly", "no",
         "--daemonize", "no", "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"redis-server did not start: {proc.stderr.read().decode()[-500:]}")
            time.sleep(0.05)
    client.close()
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
