"""Hostile input on the HTTP API of `inflight serve` (a real subprocess): schema-driven fuzzing with schemathesis
against the server's own OpenAPI schema (valid and invalid bodies for every operation), hypothesis-generated extreme
values for the sampling fields, and raw garbage bodies. After the run: no 5xx was answered, the server never logged
an unhandled exception, it still answers, and its weights are unchanged (fingerprint). About a minute in all."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings, strategies as st

from inflight.engine.serve import ServerProcess

schemathesis = pytest.importorskip("schemathesis")

# /init_process_group is left out: a valid request makes the server wait up to timeout_s for a rendezvous.
# Its rules are tested one by one in test_weight_abuse.py.
SKIP = {"/init_process_group"}
FUZZ = settings(max_examples=25, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # a generated min_weight_version the server never reaches is answered 409 after half a second
    args = ["--max-model-len", "48", "--max-batch", "8", "--version-wait-s", "0.5"]
    with ServerProcess(str(tiny_model_dir), extra_args=args, env={"OMP_NUM_THREADS": "1"}) as p:
        yield p


def fingerprint(url: str) -> tuple:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": httpx.get(url + "/v1/models").json()["data"][0]["id"], "prompt": [5, 6, 7], "max_tokens": 5,
        "seed": 11, "logprobs": 20, "ignore_eos": True})
    ch = r.json()["choices"][0]
    tops = tuple(tuple(sorted(d.values())) for d in ch["logprobs"]["top_logprobs"])
    return tuple(ch["token_ids"]), tops, httpx.get(url + "/health").json()["version"]


def assert_healthy(server, ref: tuple, failures: list) -> None:
    assert not failures, failures[:5]
    assert server.proc.poll() is None, "server died"
    log = server.log_tail(100_000)
    for marker in ("Traceback", "Exception in ASGI application", "engine step failed"):
        assert marker not in log, log[log.find(marker) - 200: log.find(marker) + 2000]
    assert fingerprint(server.url) == ref


def test_schemathesis_fuzz_of_the_openapi_schema(server, tiny_model_dir):
    ref = fingerprint(server.url)
    weights = str(tiny_model_dir / "model.safetensors")  # the server's own: a dry run of it goes through
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {"/v1/chat/completions", "/v1/completions", "/request_weight_update"} <= {o.path for o in ops}
    failures: list = []
    counts: dict[int, int] = {}
    for op in ops:
        if op.path in SKIP:
            continue
        for mode in schemathesis.GenerationMode:
            if op.method == "get" and mode == schemathesis.GenerationMode.NEGATIVE:
                continue  # nothing to make invalid

            @FUZZ
            @given(case=op.as_strategy(mode))
            def run(case) -> None:
                positive = mode == schemathesis.GenerationMode.POSITIVE
                if positive and isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = model  # else nearly every valid body is a 400 for an unknown model
                    if case.body.get("tools"):  # the tiny model's template renders no tools: always a 400 (its
                        case.body.pop("tools")  # rules are tested in tests/engine/test_tool_calls.py)
                        case.body.pop("tool_choice", None)
                if positive and op.path == "/check_weight_update" and isinstance(case.body, dict) and case.body.get(
                        "path") is not None:  # a made-up path is always a 400: a real file runs every check
                    case.body = {k: v for k, v in case.body.items() if k in ("version", "mode")} | {"path": weights}
                r = case.call(base_url=server.url, timeout=60)
                counts[r.status_code] = counts.get(r.status_code, 0) + 1
                if r.status_code >= 500:
                    failures.append((op.method, op.path, getattr(case, "body", None), r.status_code, r.text[:300]))

            run()
    print("status codes:", dict(sorted(counts.items())))
    assert sum(counts.values()) > 150 and counts.get(200, 0) > 10 and counts.get(400, 0) > 10
    assert_healthy(server, ref, failures)


big_ints = st.one_of(st.integers(-3, 70), st.integers(-(2**70), 2**70),
                     st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e-45, 1.0, 100.0]))
anything = st.recursive(st.none() | st.booleans() | big_ints | floats | st.text(max_size=20),
                        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                        max_leaves=12)
FIELDS = {
    "temperature": floats, "top_p": floats, "top_k": big_ints, "n": big_ints, "max_tokens": big_ints,
    "seed": big_ints, "logprobs": st.one_of(big_ints, st.booleans()), "top_logprobs": big_ints,
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=3), max_size=20), anything),
    "stop_token_ids": st.lists(big_ints, max_size=4), "ignore_eos": anything, "stream": st.booleans(),
    "stream_options": anything, "presence_penalty": floats, "logit_bias": anything, "echo": st.one_of(st.booleans(), anything),
}
# one to three hostile fields on top of a valid body: a body with many bad fields only tests the first check
sampling_fields = st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=3, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys}))
VALID = 4  # one_of picks a branch uniformly: repeat the valid value to make most prompts valid
prompts = st.one_of(*[st.just([5, 6, 7])] * VALID, st.text(max_size=60), st.lists(big_ints, max_size=8),
                    st.lists(st.text(max_size=5), max_size=3), anything)
roles = st.sampled_from(["user", "system", "assistant", "x"])
messages = st.one_of(*[st.just([{"role": "user", "content": "1+1="}])] * VALID, anything, st.lists(
    st.fixed_dictionaries({"role": roles, "content": st.one_of(st.text(max_size=30), anything)}), max_size=3))


def test_hypothesis_extreme_sampling_values(server):
    ref = fingerprint(server.url)
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    failures: list = []
    codes: dict[int, int] = {}
    client = httpx.Client(base_url=server.url, timeout=60)

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(kind=st.sampled_from(["chat", "text"]), fields=sampling_fields, prompt=prompts, msgs=messages)
    # found by fuzzing: a top_k over int64 broke the engine step of every request in the batch
    @example(kind="text", fields={"top_k": 2**63}, prompt=[5, 6, 7], msgs=None)
    @example(kind="chat", fields={"seed": -(2**64), "stop_token_ids": [2**63]}, prompt=None, msgs=None)
    @example(kind="text", fields={"temperature": float("nan"), "top_p": float("inf")}, prompt=[1], msgs=None)
    @example(kind="text", fields={}, prompt="1\ud800", msgs=None)  # JSON allows lone surrogates; UTF-8 does not
    @example(kind="chat", fields={}, prompt=None, msgs=[{"role": "user", "content": "\udfff"}])
    def run(kind, fields, prompt, msgs) -> None:
        body = {"model": model, "max_tokens": 3, **({"messages": msgs} if kind == "chat" else {"prompt": prompt}),
                **fields}
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        data = json.dumps(body, allow_nan=True)  # NaN / Infinity literals too: Python's parser accepts them
        with client.stream("POST", path, content=data, headers={"content-type": "application/json"}) as r:
            text = r.read().decode("utf-8", "replace")
        codes[r.status_code] = codes.get(r.status_code, 0) + 1
        if r.status_code >= 500 or (r.status_code == 200 and '"error"' in text and body.get("stream")):
            failures.append((body, r.status_code, text[:300]))

    run()
    client.close()
    print("status codes:", dict(sorted(codes.items())))
    assert codes.get(200, 0) > 10 and codes.get(400, 0) > 20  # both paths exercised (17-22 valid of ~155 examples)
    assert_healthy(server, ref, failures)


def test_garbage_bodies_and_headers(server):
    ref = fingerprint(server.url)
    failures: list = []
    paths = ["/v1/chat/completions", "/v1/completions", "/request_weight_update", "/check_weight_update",
             "/init_process_group"]

    @settings(max_examples=60, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(paths), body=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)),
           ctype=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]))
    def run(path, body, ctype) -> None:
        r = httpx.post(server.url + path, content=body, headers={"content-type": ctype} if ctype else {}, timeout=30)
        if r.status_code >= 500 or r.status_code == 200:
            failures.append((path, body[:80], ctype, r.status_code, r.text[:200]))

    run()
    assert_healthy(server, ref, failures)
