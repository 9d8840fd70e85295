"""The vLLM backend honours the inflight contract: the conformance suite, both weight transports (whole and
partial updates), the 4xx errors, and per-token versions across an update in the middle of a generation.
Logprobs are checked against a float64 forward of the same weights written here."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.vllm.conftest import assert_conformance

VLLM_PYTHON = os.environ.get("INFLIGHT_VLLM_PYTHON", "")
needs_vllm = pytest.mark.skipif(not (VLLM_PYTHON and os.path.exists(VLLM_PYTHON)),
                                reason="set INFLIGHT_VLLM_PYTHON to the python of the vLLM venv (make test-vllm)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, needs_vllm]
MSG = [{"role": "user", "content": "12+34="}]


def _reference(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """float64 log_softmax of the logits = the temperature-1 logprob of each token (the contract's greedy μ)."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].double(), -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def _greedy(url: str, name: str, max_tokens: int = 8) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": name, "messages": MSG, "max_tokens": max_tokens, "temperature": 0, "logprobs": True,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    ch["lps"] = [c["logprob"] for c in ch["logprobs"]["content"]]
    return ch


def _perturb(model, scale: float = 0.3) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


@pytest.fixture(scope="module")
def hf_model(vllm_model_dir):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float64)


def test_conformance_suite(vllm_server):
    assert_conformance(vllm_server.url)


def test_structured_outputs_are_a_400_on_this_backend(vllm_server):
    """Our routes over vLLM do not constrain outputs (the built-in engine does): asking is a 400 naming the field,
    never a reply that silently ignores the constraint."""
    name = httpx.get(vllm_server.url + "/v1/models").json()["data"][0]["id"]
    for extra, param in (({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
                         ({"guided_choice": ["a", "b"]}, "guided_choice")):
        r = httpx.post(vllm_server.url + "/v1/chat/completions", timeout=60, json={
            "model": name, "messages": MSG, "max_tokens": 4, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "built-in engine" in err["message"], err


def test_weight_updates_file_and_process_group(vllm_server, hf_model, vllm_model_dir):
    from inflight.trainer.weight_sync.inflight import WeightSyncClient

    url, name = vllm_server.url, Path(vllm_model_dir).name
    ch = _greedy(url, name)
    assert ch["token_versions"] == [0] * 8
    ref = _reference(hf_model, ch["prompt_token_ids"], ch["token_ids"])
    assert max(abs(a - b) for a, b in zip(ch["lps"], ref)) < 1e-4

    # broadcast before joining a group: 409; bad announcements: 400 naming the problem, nothing changes
    one = {"name": "lm_head.weight", "shape": list(hf_model.lm_head.weight.shape), "dtype": "float32"}
    r = httpx.post(url + "/request_weight_update", json={"version": 9, "params": [one]})
    assert r.status_code == 409 and "init_process_group" in r.text
    for bad, word in [({**one, "name": "nope.weight"}, "unknown"), ({**one, "shape": [1, 2]}, "shape"),
                      ({**one, "dtype": "bfloat16"}, "dtype")]:
        r = httpx.post(url + "/check_weight_update", json={"version": 9, "params": [bad]})
        assert r.status_code in (400, 409), r.text
    r = httpx.post(url + "/request_weight_update", json={"version": 9, "path": "/no/such.safetensors"})
    assert r.status_code == 400 and "not a readable safetensors file" in r.text
    r = httpx.post(url + "/request_weight_update", json={"version": 9, "path": "relative.safetensors"})
    assert r.status_code == 400 and "absolute" in r.text

    version = 0
    # the process group per tensor, then with the small tensors packed in 64 KiB buckets (the worker unpacks them),
    # then the shared-memory segment (the worker copies from its views)
    for transport, bucket in (("file", 0), ("process_group", 0), ("process_group", 2**16), ("shm", 0)):
        client = WeightSyncClient([url], transport=transport, bucket_bytes=bucket)
        try:
            client.init_process_group()
            if transport == "process_group" and not bucket:  # now the 400s of a joined server
                for bad, word in [({**one, "name": "nope.weight"}, "unknown"), ({**one, "shape": [1, 2]}, "shape"),
                                  ({**one, "dtype": "bfloat16"}, "dtype")]:
                    r = httpx.post(url + "/request_weight_update", json={"version": 9, "params": [bad]})
                    assert r.status_code == 400 and word in r.text, r.text
            _perturb(hf_model)  # whole model
            version += 1
            stats = client.push(((n, p.float()) for n, p in hf_model.named_parameters()), version=version)
            assert stats["pause_s"][url] >= 0
            assert not bucket or len(client._layout[1]) < stats["num_tensors"]  # packed: fewer broadcasts
            ch = _greedy(url, name)
            assert ch["token_versions"] == [version] * 8
            ref = _reference(hf_model, ch["prompt_token_ids"], ch["token_ids"])
            assert max(abs(a - b) for a, b in zip(ch["lps"], ref)) < 1e-4, (transport, bucket)
            with torch.no_grad():  # partial update: one tensor, the others keep their values
                hf_model.lm_head.weight.mul_(-1.5)
            version += 1
            client.push([("lm_head.weight", hf_model.lm_head.weight.float())], version=version)
            ch = _greedy(url, name)
            assert ch["token_versions"] == [version] * 8
            ref = _reference(hf_model, ch["prompt_token_ids"], ch["token_ids"])
            assert max(abs(a - b) for a, b in zip(ch["lps"], ref)) < 1e-4, (transport, bucket)
        finally:
            client.close()
    assert httpx.get(url + "/health").json()["version"] == version
    assert f"inflight_weight_version {version}" in httpx.get(url + "/metrics").text


@pytest.mark.parametrize("mode", ["interrupt", "keep"])
def test_update_in_the_middle_of_a_generation(vllm_server, hf_model, vllm_model_dir, mode):
    """Versions switch inside one choice and never decrease; in interrupt mode the tokens after the switch are
    exactly those of the new weights over the whole sequence (the KV cache was recomputed)."""
    from inflight.trainer.weight_sync.inflight import WeightSyncClient

    url, name = vllm_server.url, Path(vllm_model_dir).name
    old = httpx.get(url + "/health").json()["version"]
    for attempt in range(3):
        got: dict = {}

        def generate() -> None:
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
                    "model": name, "messages": MSG, "max_tokens": 220, "temperature": 0, "logprobs": True,
                    "ignore_eos": True, "stream": True}) as r:
                ids, vers, lps = [], [], []
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    c = json.loads(line[6:])["choices"][0]
                    ids += c.get("token_ids", [])
                    vers += c.get("token_versions", [])
                    lps += [e["logprob"] for e in (c.get("logprobs") or {}).get("content", [])]
                    got["prompt"] = c.get("prompt_token_ids", got.get("prompt"))
                    got["started"] = True
                got.update(ids=ids, vers=vers, lps=lps)

        th = threading.Thread(target=generate)
        th.start()
        while not got.get("started"):
            time.sleep(0.005)
        _perturb(hf_model, 0.2)
        new = old + 1 + attempt
        client = WeightSyncClient([url], transport="file")
        client.push(((n, p.float()) for n, p in hf_model.named_parameters()), version=new, mode=mode)
        client.close()
        th.join()
        old = new
        vers = got["vers"]
        assert len(vers) == len(got["ids"]) == len(got["lps"]) == 220
        assert vers == sorted(vers)
        if vers[0] != vers[-1]:
            break
    else:
        pytest.fail("the generation never straddled an update in 3 tries")
    assert vers[-1] == new
    switch = vers.index(new)
    if mode == "interrupt":
        ref = _reference(hf_model, got["prompt"], got["ids"])
        # vLLM's CPU kernels differ from transformers' by up to ~3e-4 late in a 220-token sequence (seen once at
        # index 165); a KV cache left from weights perturbed by 0.2 would differ by far more than 2e-3.
        bad = [(i, got["lps"][i], ref[i]) for i in range(switch, len(ref)) if abs(got["lps"][i] - ref[i]) >= 2e-3]
        assert not bad, f"switch at {switch}, mismatches (index, server, reference): {bad[:5]}"


def test_hostile_weight_requests(vllm_server, vllm_model_dir):
    """What tests/security/test_weight_hostile.py checks on the built-in server: the master-address rule, the bounded
    group timeout, a rendezvous that never comes (file updates go on; the next join supersedes it), stale versions
    (409), and a dry run of a missing file (400)."""
    from inflight.process import free_port
    from inflight.trainer.weight_sync.inflight import WeightSyncClient

    url = vllm_server.url
    ckpt = str(Path(vllm_model_dir) / "model.safetensors")
    base = {"rank_offset": 1, "world_size": 2, "timeout_s": 5}
    for address, port in (("198.51.100.7", 29500), ("127.0.0.1", 22), ("127.0.0.1", vllm_server.port)):
        r = httpx.post(url + "/init_process_group", json={**base, "master_address": address, "master_port": port})
        assert r.status_code == 403 and "master" in r.text, (address, port, r.text)
    r = httpx.post(url + "/init_process_group", json={**base, "master_address": "127.0.0.1",
                                                      "master_port": free_port(), "timeout_s": 1e9})
    assert r.status_code == 400 and "timeout_s" in r.text, r.text

    v = httpx.get(url + "/health").json()["version"]
    answer: list = []
    dead = {**base, "master_address": "127.0.0.1", "master_port": free_port(), "timeout_s": 600}
    t = threading.Thread(target=lambda: answer.append(httpx.post(url + "/init_process_group", json=dead,
                                                                 timeout=120)))
    t.start()
    time.sleep(2)  # the workers are waiting for the rendezvous
    r = httpx.post(url + "/request_weight_update", json={"version": v + 1, "path": ckpt}, timeout=60)
    assert r.status_code == 200 and t.is_alive(), r.text
    client = WeightSyncClient([url])
    try:
        client.init_process_group()  # supersedes the dead join
        t.join(30)
        assert answer and answer[0].status_code == 409 and "superseded" in answer[0].text
    finally:
        client.close()
    for route in ("/check_weight_update", "/request_weight_update"):
        r = httpx.post(url + route, json={"version": v, "path": ckpt}, timeout=60)
        assert r.status_code == 409 and "stale version" in r.text, (route, r.text)
    r = httpx.post(url + "/check_weight_update", json={"version": v + 1, "path": "/nonexistent/x.safetensors"})
    assert r.status_code == 400 and "not a readable safetensors file" in r.text
    assert httpx.get(url + "/health").json()["version"] == v + 1

