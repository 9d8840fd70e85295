"""One short pipelined run on the vLLM backend: `inflight train` drives a vLLM-backed inflight server (started from
the vLLM venv) through the two contracts; weights go over the gloo group after every optimizer step."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.reliability.pipeline_helpers import free_port, records

VLLM_PYTHON = os.environ.get("INFLIGHT_VLLM_PYTHON", "")
pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not (VLLM_PYTHON and os.path.exists(VLLM_PYTHON)),
                                 reason="set INFLIGHT_VLLM_PYTHON to the python of the vLLM venv (make test-vllm)")]
STEPS, GPS, G, MAX_LAG = 6, 2, 4, 1


@pytest.mark.timeout(600)
def test_pipelined_run_on_the_vllm_backend(vllm_model_dir, tmp_path):
    from inflight.engine.vllm_backend.process import VLLMServerProcess

    with VLLMServerProcess(str(vllm_model_dir), python=VLLM_PYTHON, env={"OMP_NUM_THREADS": "1"},
                           vllm_args=["--dtype", "float32", "--max-model-len", "256", "-O0"]) as server:
        run = tmp_path / "vllm-run"
        args = [f"model.path={vllm_model_dir}", "name=vllm-run", f"pipeline.run_dir={tmp_path}",
                f"pipeline.server_urls=[{server.url}]", f"pipeline.weight_sync_port={free_port()}",
                f"pipeline.max_steps={STEPS}", "pipeline.progress=false", "pipeline.tensorboard=false",
                "trainer.threads=1", "task.eval_size=8", "actor.eval_every=0", f"actor.group_size={G}",
                f"actor.groups_per_step={GPS}", "actor.max_new_tokens=32", f"actor.max_lag={MAX_LAG}"]
        p = subprocess.run([sys.executable, "-m", "inflight.cli", "train", "/dev/null", *args], capture_output=True,
                           text=True, timeout=480, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:]
        health = httpx.get(server.url + "/health", timeout=5).json()

    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["samples"] for r in steps] == [G * GPS] * STEPS
    assert all(0 <= r["lag_min"] and r["lag_max"] <= MAX_LAG for r in steps)
    assert health["version"] == STEPS  # the server ended on the trainer's last weights
