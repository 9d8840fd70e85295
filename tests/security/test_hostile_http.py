"""Hostile requests to `inflight serve` (a real subprocess, on loopback), one defect class each: a stream refused
409 that kept its queue places, tiny temperatures, refused chat prompts kept in the render cache, tokenizing that
blocked the event loop, and errors outside OpenAI's shape. After each attack a normal request answers exactly as
before (fingerprint: seeded sampling with top logprobs). Slow clients, the key at the edge and proxy headers are in
test_slow_clients.py."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from inflight.engine.serve import ServerProcess
from tests.servers import answers_normally, fingerprint, openai_error, rss_mb

BODY_LIMIT = 2 * 2**20  # this server's maximal request: tokenizing it takes seconds on one core
CONTEXT = 64


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # --no-prefix-reuse: the fingerprint repeats one request and must be bit-reproducible
    args = ["--max-model-len", str(CONTEXT), "--max-batch", "4", "--max-waiting", "0", "--version-wait-s", "1",
            "--max-body-bytes", str(BODY_LIMIT), "--no-prefix-reuse"]
    with ServerProcess(str(tiny_model_dir), extra_args=args, env={"OMP_NUM_THREADS": "1"}) as p:
        p.model = httpx.get(p.url + "/v1/models").json()["data"][0]["id"]
        p.ref = fingerprint(p)
        yield p
        log = p.log_tail(100_000)
        assert "Traceback" not in log, log[log.find("Traceback") - 200: log.find("Traceback") + 2000]


def completion(server, timeout: float = 60, **kw) -> httpx.Response:
    body = {"model": server.model, "prompt": [5, 6, 7], "max_tokens": 5, "ignore_eos": True, **kw}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=timeout)


# ---- a stream answered 409 gives its queue places back ---------------------------------------------------------------
def test_stream_refused_409_gives_its_queue_places_back(server):
    def stream(n: int) -> httpx.Response:
        body = {"model": server.model, "prompt": [5, 6], "max_tokens": 4, "stream": True, "n": n,
                "min_weight_version": 99}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            r.read()
        return r

    openai_error(stream(4), 409)  # the whole capacity (max_batch 4 + max_waiting 0)
    with ThreadPoolExecutor(4) as pool:  # four n=1 streams at once: the capacity again
        for r in pool.map(stream, [1] * 4):
            assert openai_error(r, 409)["param"] == "min_weight_version"
    r = completion(server, n=4)  # every place is free again
    assert r.status_code == 200, r.text
    answers_normally(server)


# ---- a tiny temperature is greedy ------------------------------------------------------------------------------------
@pytest.mark.parametrize("logprobs", [0, 1])  # 0: the C sampler (no top logprobs), 1: the torch one
def test_tiny_temperature_samples_greedily(server, logprobs):
    greedy = completion(server, temperature=0, logprobs=logprobs).json()["choices"][0]
    for t in (1e-39, 1e-30, 1e-8):  # 1e-39 overflowed logits / t to inf: null logprobs, unsampled tokens
        r = completion(server, temperature=t, logprobs=logprobs, seed=5)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        lps = ch["logprobs"]["token_logprobs"]
        assert ch["token_ids"] == greedy["token_ids"], t
        assert all(lp is not None and math.isfinite(lp) for lp in lps), (t, lps)
        assert lps == greedy["logprobs"]["token_logprobs"], t  # greedy's convention: the temperature-1 logprob
    answers_normally(server)


# ---- refused chat prompts are not kept -------------------------------------------------------------------------------
def test_refused_chat_prompts_are_not_kept(server):
    def refused_chat(i: int) -> None:
        content = f"{i} " + "ab" * int(BODY_LIMIT * 0.35)  # distinct each time, 1.4 MB: no cache may answer it
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": server.model, "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
        assert openai_error(r, 400)["code"] == "context_length_exceeded"

    for i in range(2):  # allocator arenas and the rendering thread reach their working size
        refused_chat(i)
    before = rss_mb(server.proc.pid)
    for i in range(2, 8):  # kept, these would take ~6 x 13 MB (key and token ids): 20% of the server's RSS
        refused_chat(i)
    after = rss_mb(server.proc.pid)
    print(f"RSS {before:.0f} -> {after:.0f} MB over 6 refused 1.4 MB chats")
    assert after <= 1.10 * before, f"RSS grew {before:.0f} -> {after:.0f} MB"
    answers_normally(server)


# ---- tokenizing a maximal prompt does not block the event loop -------------------------------------------------------
@pytest.mark.parametrize("kind", ["text", "chat"])
def test_health_answers_while_a_maximal_prompt_is_tokenized(server, kind):
    text = "1+" * (BODY_LIMIT // 2 - 200)  # just under the body limit
    if kind == "text":
        path, body = "/v1/completions", {"model": server.model, "prompt": text, "max_tokens": 2}
    else:
        path, body = "/v1/chat/completions", {"model": server.model, "max_tokens": 2,
                                              "messages": [{"role": "user", "content": text}]}
    answer: list[httpx.Response] = []
    t = threading.Thread(target=lambda: answer.append(httpx.post(server.url + path, json=body, timeout=120)))
    t0 = time.monotonic()
    t.start()
    time.sleep(0.3)  # the body is read: tokenizing it takes seconds
    latencies = []
    while t.is_alive():
        s = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        latencies.append(time.monotonic() - s)
        time.sleep(0.1)
    t.join()
    took = time.monotonic() - t0
    print(f"{kind}: {took:.1f} s to refuse the prompt; /health answered {len(latencies)} times, slowest "
          f"{max(latencies, default=0):.3f} s")
    assert openai_error(answer[0], 400)["code"] == "context_length_exceeded"
    # a blocked loop answers /health after the rest of the tokenization; a free one within a small part of it. Busy
    # cores (another test beside this one) slow both: 7-8 s to refuse, /health up to 1 s, beside two busy processes
    slowest = max(latencies)
    assert slowest < max(0.5, took / 4), f"/health took {slowest:.2f} s beside a {took:.1f} s tokenization"
    assert len(latencies) >= 3, f"the prompt was refused in {took:.1f} s: not a test of a long tokenization"
    answers_normally(server)


# ---- every error in OpenAI's shape -----------------------------------------------------------------------------------
def test_unknown_routes_and_deep_json_answer_openai_errors(server):
    openai_error(httpx.get(server.url + "/v1/nothing"), 404)
    r = httpx.get(server.url + "/v1/completions")
    openai_error(r, 405)
    assert r.headers["allow"] == "POST"
    deep = [b"[" * 5000, b"[" * 5000 + b"]" * 5000, b'{"a":' * 5000 + b"1" + b"}" * 5000]
    for body in deep:  # past the JSON parser's nesting limit
        r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert "nested too deeply" in openai_error(r, 400)["message"]
    answers_normally(server)
