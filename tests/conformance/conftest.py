"""The conformance suite runs against any server that implements docs/inference-contract.md:

    pytest tests/conformance --server-url http://host:port [--server-api-key KEY]
    INFLIGHT_SERVER_URL=http://host:port pytest tests/conformance

Without a URL it starts `inflight serve` in a subprocess, on the tiny test model and (slow) on SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import os

import httpx
import pytest


def pytest_addoption(parser):
    parser.addoption("--server-url", default=None, help="run the conformance suite against this server")
    parser.addoption("--server-api-key", default=None, help="API key of --server-url")


def _opt(config, name: str, env: str) -> str | None:
    try:
        value = config.getoption(name)
    except ValueError:  # option not registered (this conftest loaded late)
        value = None
    return value or os.environ.get(env) or None


@pytest.fixture(scope="session", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def server(request):
    """(base url, api key) of the server under test: --server-url, or `inflight serve` on the tiny test model and
    then on SmolLM2-135M-Instruct (a real pretrained model: tied embeddings, BPE vocabulary, chat template)."""
    url = _opt(request.config, "--server-url", "INFLIGHT_SERVER_URL")
    key = _opt(request.config, "--server-api-key", "INFLIGHT_SERVER_API_KEY")
    if url:
        if request.param != "tiny":
            pytest.skip("--server-url: the suite runs once, against that server")
        yield url.rstrip("/"), key
        return
    from inflight.engine.serve import ServerProcess

    model = request.getfixturevalue("tiny_model_dir" if request.param == "tiny" else "smollm2_dir")
    with ServerProcess(str(model), extra_args=["--max-model-len", "256", "--max-batch", "32"],
                       env={"OMP_NUM_THREADS": "1"}) as proc:
        yield proc.url, None


@pytest.fixture(scope="session")
def model_name(server) -> str:
    url, key = server
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    url, key = server
    with OpenAI(base_url=url + "/v1", api_key=key or "none", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def http(server):
    url, key = server
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
        yield c
