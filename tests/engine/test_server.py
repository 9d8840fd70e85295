"""Built-in server specifics (beyond tests/conformance): API key, metrics, disconnects, logprobs vs transformers,
and 1,000 concurrent clients. Servers run as real `inflight serve` subprocesses."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch

from inflight.engine.serve import ServerProcess

torch.set_num_threads(1)
MSG = [{"role": "user", "content": "5+6="}]
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    with ServerProcess(str(tiny_model_dir), extra_args=["--api-key", "s3cret", "--max-model-len", "512"],
                       env=ENV) as proc:
        yield proc


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_api_key_required_everywhere_but_health(keyed):
    good, bad = {"Authorization": "Bearer s3cret"}, {"Authorization": "Bearer nope"}
    assert httpx.get(keyed.url + "/health").status_code == 200
    for method, path, body in [("GET", "/v1/models", None), ("GET", "/metrics", None),
                               ("POST", "/v1/chat/completions", {"model": "x", "messages": MSG}),
                               ("POST", "/v1/completions", {"model": "x", "prompt": "1"}),
                               ("POST", "/request_weight_update", {"version": 1, "path": "/x"}),
                               ("POST", "/init_process_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                                "rank_offset": 1, "world_size": 2})]:
        for headers in ({}, bad):
            r = httpx.request(method, keyed.url + path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.status_code)
    r = httpx.get(keyed.url + "/v1/models", headers=good)
    assert r.status_code == 200
    model = r.json()["data"][0]["id"]
    from openai import AuthenticationError, OpenAI

    with pytest.raises(AuthenticationError):
        OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).models.list()
    ok = OpenAI(base_url=keyed.url + "/v1", api_key="s3cret", max_retries=0)
    assert ok.chat.completions.create(model=model, messages=MSG, max_tokens=2).choices[0].message is not None
    assert "401" in keyed.log_tail(200)  # rejections are logged


def test_logprobs_equal_transformers_forward(keyed, tiny_model_dir):
    """Completions endpoint, token-id prompt, temperature 0.7: logprobs of the sampled tokens vs a float64
    log-softmax over an independent transformers forward of the same weights."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model = httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Bearer s3cret"}).json()["data"][0]["id"]
    prompt = [7, 8, 9, 10, 11, 12]
    r = httpx.post(keyed.url + "/v1/completions", headers={"Authorization": "Bearer s3cret"}, timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 20, "temperature": 0.7, "logprobs": 0, "ignore_eos": True})
    ch = r.json()["choices"][0]
    ids = prompt + ch["token_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    ref = torch.log_softmax(logits / 0.7, -1)
    want = [ref[t - 1, ids[t]].item() for t in range(len(prompt), len(ids))]
    got = ch["logprobs"]["token_logprobs"]
    assert len(got) == 20
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


def test_disconnect_cancels_generation(keyed):
    headers = {"Authorization": "Bearer s3cret"}
    model = httpx.get(keyed.url + "/v1/models", headers=headers).json()["data"][0]["id"]
    before = _metric(httpx.get(keyed.url + "/metrics", headers=headers).text, "inflight_generated_tokens_total")
    body = {"model": model, "messages": MSG, "max_tokens": 480, "ignore_eos": True, "n": 8, "stream": True}
    with httpx.stream("POST", keyed.url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if '"token_ids"' in line:
                break  # first tokens arrived: hang up
    deadline = time.monotonic() + 20
    while True:
        m = httpx.get(keyed.url + "/metrics", headers=headers).text
        if _metric(m, "inflight_running_requests") == 0:
            break
        assert time.monotonic() < deadline, "generation kept running after the client left"
        time.sleep(0.05)
    generated = _metric(m, "inflight_generated_tokens_total") - before
    assert generated < 8 * 480  # cancelled long before max_tokens
    # non-streaming request whose client times out: cancelled too
    body = {**body, "stream": False, "n": 64}  # ~30k tokens: far more than 0.3 s of work
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(keyed.url + "/v1/chat/completions", json=body, headers=headers, timeout=0.3)
    deadline = time.monotonic() + 20
    while _metric(httpx.get(keyed.url + "/metrics", headers=headers).text, "inflight_running_requests") > 0:
        assert time.monotonic() < deadline, "non-streaming generation kept running after the client left"
        time.sleep(0.05)


@pytest.mark.slow
def test_thousand_concurrent_chat_requests(tiny_model_dir):
    with ServerProcess(str(tiny_model_dir), extra_args=["--max-batch", "128"], env=ENV) as proc:
        model = httpx.get(proc.url + "/v1/models").json()["data"][0]["id"]

        async def run() -> list[dict]:
            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
            async with httpx.AsyncClient(base_url=proc.url, limits=limits, timeout=300) as c:
                async def one(i: int) -> dict:
                    r = await c.post("/v1/chat/completions", json={
                        "model": model, "messages": [{"role": "user", "content": f"{i}+1="}], "max_tokens": 4,
                        "ignore_eos": True, "seed": i})
                    assert r.status_code == 200, r.text
                    return r.json()
                return await asyncio.gather(*(one(i) for i in range(1000)))

        t0 = time.perf_counter()
        answers = asyncio.run(run())
        elapsed = time.perf_counter() - t0
        assert len(answers) == 1000
        assert len({a["id"] for a in answers}) == 1000
        for a in answers:
            ch = a["choices"][0]
            assert len(ch["token_ids"]) == 4 and ch["finish_reason"] == "length" and ch["prompt_token_ids"]
        # each answer belongs to its request: the prompt ids encode "{i}+1="
        tok = __import__("transformers").AutoTokenizer.from_pretrained(tiny_model_dir)
        for i in (0, 17, 999):
            assert f"{i}+1=" in tok.decode(answers[i]["choices"][0]["prompt_token_ids"])
        m = httpx.get(proc.url + "/metrics").text
        assert _metric(m, "inflight_generated_tokens_total") >= 4000
        print(f"1000 concurrent chat requests answered in {elapsed:.1f}s")


def test_min_weight_version_waits_for_the_push_or_gets_409(tiny_model_dir):
    """A request for weights the server does not hold yet starts once a push brings them (every token from them);
    one for a version that never comes is answered 409 after --version-wait-s, not held forever."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForCausalLM

    from inflight.trainer.weight_sync.inflight import WeightSyncClient

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with ServerProcess(str(tiny_model_dir), extra_args=["--version-wait-s", "2"], env=ENV) as proc:
        model = httpx.get(proc.url + "/v1/models").json()["data"][0]["id"]

        def ask(min_version: int, stream: bool = False) -> tuple[httpx.Response, float]:
            body = {"model": model, "messages": MSG, "max_tokens": 6, "ignore_eos": True,
                    "min_weight_version": min_version, "stream": stream}
            r = httpx.post(proc.url + "/v1/chat/completions", json=body, timeout=60)
            return r, time.monotonic()

        sync = WeightSyncClient([proc.url], timeout_s=60)
        sync.init_process_group()
        try:
            with ThreadPoolExecutor(2) as pool:
                waiting, streaming = pool.submit(ask, 1), pool.submit(ask, 1, True)
                time.sleep(0.5)
                assert not waiting.done() and not streaming.done()  # held: the server is at version 0
                pushed_at = time.monotonic()
                sync.push(hf.named_parameters(), version=1)
                r, answered_at = waiting.result()
                rs, _ = streaming.result()
            assert r.status_code == 200 and answered_at > pushed_at
            assert r.json()["choices"][0]["token_versions"] == [1] * 6
            chunks = [json.loads(line[6:]) for line in rs.text.splitlines() if line.startswith("data: {")]
            assert rs.status_code == 200 and [v for c in chunks for ch in c["choices"]
                                              for v in ch.get("token_versions", [])] == [1] * 6
            for stream in (False, True):  # a version that never comes: 409, also before a stream's headers
                t0 = time.monotonic()
                r, _ = ask(2, stream)
                assert r.status_code == 409 and 2 <= time.monotonic() - t0 < 10
                assert "min_weight_version 2" in r.json()["error"]["message"]
        finally:
            sync.close()
