"""OpenEnv tests: they need openenv-core, which lives in its own test venv (scripts/openenv-env.sh; `make
test-openenv` builds it and runs these tests with its python). Elsewhere they skip (SKIP_REASON). Each module starts the guessing
game's OpenEnv server (guess_env.py) as a real process: uvicorn, the /ws session protocol."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from tests.reliability.pipeline_helpers import free_port

REPO = Path(__file__).resolve().parents[2]
AGENT = "tests.openenv_task.guess_agent"
SKIP_REASON = "needs openenv-core: the OpenEnv test venv (make test-openenv, scripts/openenv-env.sh)"


@contextmanager
def guess_server(max_sessions: int) -> Iterator[str]:
    """The guessing game's OpenEnv server on a free port; yields its URL."""
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: an unread pipe that fills up stalls the server
    proc = subprocess.Popen([sys.executable, "-m", "tests.openenv_task.guess_env", "--port", str(port), "--max-sessions",
                             str(max_sessions)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # openenv's import (gradio, fastmcp) takes ~10 s on a busy host
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the OpenEnv server exited: {log.read()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the OpenEnv server did not start in 120 s")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
