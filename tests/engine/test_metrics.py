"""GET /metrics through prometheus_client (engine/api/metrics.py): the engine's counters and gauges under their
names, and the histograms of the requests served (queue time, time to first token, time per output token, end-to-end
latency), of the weight updates' pauses and of the served tokens' policy lag, parsed back with prometheus_client's
own parser from a real `inflight serve`; plus Generation's timings over an engine without stamps (the vLLM
backend's) and one registry per app."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from inflight.engine.api.metrics import ServerMetrics
from inflight.engine.model.sampling import SamplingParams
from inflight.engine.scheduler.request import Generation
from inflight.engine.scheduler.sequence import TokenEvent
from inflight.pipeline.scrape import parse_prometheus
from tests.servers import model_of, serve_model

torch.set_num_threads(1)
ENGINE_NAMES = {  # what the launcher's scraper, the bench and the docs read, by type
    "inflight_running_requests": "gauge", "inflight_waiting_requests": "gauge", "inflight_batch_occupancy": "gauge",
    "inflight_weight_version": "gauge", "inflight_retained_sequences": "gauge",
    "inflight_generated_tokens": "counter", "inflight_paused_seconds": "counter", "inflight_engine_steps": "counter",
    "inflight_prefill_tokens": "counter", "inflight_prefix_reused_tokens": "counter",
    "inflight_weight_updates": "counter", "inflight_rejected_requests": "counter",
}
HISTOGRAMS = ("inflight_request_queue_time_seconds", "inflight_time_to_first_token_seconds",
              "inflight_time_per_output_token_seconds", "inflight_e2e_request_latency_seconds",
              "inflight_weight_update_pause_seconds", "inflight_served_token_policy_lag_versions")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve_model(tiny_model_dir) as proc:
        yield proc


def scrape(url: str) -> dict[str, dict[str, float]]:
    """{family: {sample name: value}} (a histogram's buckets as `<name>_bucket:<le>`), and {"#type": {family: type}}."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, dict[str, float]] = {"#type": {}}
    for fam in text_string_to_metric_families(text):
        out["#type"][fam.name] = fam.type
        rows = out.setdefault(fam.name, {})
        for s in fam.samples:
            key = s.name + (":" + s.labels["le"] if "le" in s.labels else "")
            rows[key] = s.value
    return out


def hist(m: dict, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram."""
    return m[name][name + "_count"], m[name][name + "_sum"]


def delta(after: dict, before: dict, name: str) -> tuple[float, float]:
    (c1, s1), (c0, s0) = hist(after, name), hist(before, name)
    return c1 - c0, s1 - s0


def push_file(url: str, tiny_model_dir, tmp_path, version: int) -> dict:
    """A weight update over the file transport (slightly changed weights)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(version)
    new = {n: (p.detach() + 0.01 * torch.randn(p.shape, generator=g)).contiguous() for n, p in hf.named_parameters()}
    path = tmp_path / f"w{version}.safetensors"
    save_file(new, str(path))
    r = httpx.post(url + "/request_weight_update", timeout=120,
                   json={"version": version, "mode": "keep", "path": str(path)})
    assert r.status_code == 200, r.text
    return r.json()


def stream_versions(url: str, versions: dict[int, list[int]], n: int = 1) -> None:
    """A streamed chat reply of `n` choices of 400 tokens; each choice's versions are appended to `versions[index]`
    as they come."""
    body = {"model": model_of(url), "messages": [{"role": "user", "content": "count"}], "max_tokens": 400,
            "ignore_eos": True, "stream": True, "n": n}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                versions.setdefault(ch.get("index", 0), []).extend(ch.get("token_versions", []))


def test_the_engine_s_metrics_keep_their_names(server):
    text = httpx.get(server.url + "/metrics").text
    m = scrape(server.url)
    for name, kind in ENGINE_NAMES.items():
        assert m["#type"][name] == kind, name
    for name in HISTOGRAMS:
        assert m["#type"][name] == "histogram", name
        assert m[name][name + "_bucket:+Inf"] == m[name][name + "_count"]
    # the launcher's scraper (pipeline/scrape.py) and the bench read `name value` lines: counters end in _total,
    # as they always did, with no _created sample of their own
    flat = parse_prometheus(text)
    for name, kind in ENGINE_NAMES.items():
        assert (name + "_total" if kind == "counter" else name) in flat, name
        assert name + "_created" not in flat
    assert "inflight_weight_updates_total 0" in text  # as tests/engine/test_routers.py and the docs read it


def test_histograms_count_the_requests_and_tokens_served(server):
    url, model = server.url, model_of(server.url)
    before = scrape(url)
    full = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "ignore_eos": True, "n": 2})
    chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "1+2="}], "max_tokens": 1, "ignore_eos": True})
    streamed = []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "model": model, "messages": [{"role": "user", "content": "3+4="}], "max_tokens": 9, "ignore_eos": True,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0].get("token_ids", [])
    assert full.status_code == chat.status_code == 200
    after = scrape(url)
    tokens = full.json()["usage"]["completion_tokens"] + chat.json()["usage"]["completion_tokens"] + len(streamed)
    assert tokens == 2 * 6 + 1 + 9
    requests = 3
    queue, ttft, e2e = (delta(after, before, n) for n in ("inflight_request_queue_time_seconds",
                                                          "inflight_time_to_first_token_seconds",
                                                          "inflight_e2e_request_latency_seconds"))
    tpot = delta(after, before, "inflight_time_per_output_token_seconds")
    lag = delta(after, before, "inflight_served_token_policy_lag_versions")
    assert queue[0] == ttft[0] == e2e[0] == requests
    assert tpot[0] == 2 + 1  # the choices of 2 tokens or more: the chat reply of 1 token has no time per token
    assert lag == (tokens, 0)  # every token sampled by the weights that ended its choice (no update)
    gen_before = before["inflight_generated_tokens"]["inflight_generated_tokens_total"]
    assert after["inflight_generated_tokens"]["inflight_generated_tokens_total"] - gen_before == tokens
    # plausible: each request waited, got its first token, then ended, in that order, within seconds
    assert 0 <= queue[1] <= ttft[1] <= e2e[1] < 60 * requests
    assert ttft[1] > 0 and 0 < tpot[1] < e2e[1]
    assert after["inflight_served_token_policy_lag_versions"]["inflight_served_token_policy_lag_versions_bucket:0.0"] \
        - before["inflight_served_token_policy_lag_versions"]["inflight_served_token_policy_lag_versions_bucket:0.0"] \
        == tokens


def test_a_weight_update_is_one_pause(server, tiny_model_dir, tmp_path):
    before = scrape(server.url)
    assert hist(before, "inflight_weight_update_pause_seconds") == (0, 0)  # the module's first update
    answer = push_file(server.url, tiny_model_dir, tmp_path, version=1)
    after = scrape(server.url)
    count, total = hist(after, "inflight_weight_update_pause_seconds")
    assert count == 1 and after["inflight_weight_updates"]["inflight_weight_updates_total"] == 1
    assert total == pytest.approx(answer["pause_s"]) and 0 < total < 30
    paused = after["inflight_paused_seconds"]["inflight_paused_seconds_total"]
    assert total <= paused + 1e-6  # the engine's pause holds the update's


def test_tokens_sampled_before_an_update_are_a_version_behind(server, tiny_model_dir, tmp_path):
    """Streamed choices across a `keep` update: their tokens of the old weights lag one version behind the weights
    that end them. 32 choices slow each decode step to ~1.5 ms, the push starts at the first token, and it tries 8
    times: on a busy host the generation may still end before the update lands."""
    url = server.url
    n = 32
    for _attempt in range(8):
        version = httpx.get(url + "/health").json()["version"] + 1  # versions are steps: the next one
        by_choice: dict[int, list[int]] = {}
        before = scrape(url)
        t = threading.Thread(target=stream_versions, args=(url, by_choice, n))
        t.start()
        while not by_choice and t.is_alive():
            time.sleep(0.005)
        push_file(url, tiny_model_dir, tmp_path, version)
        t.join()
        after = scrape(url)
        count, total = delta(after, before, "inflight_served_token_policy_lag_versions")
        assert sorted(by_choice) == list(range(n)) and all(len(v) == 400 for v in by_choice.values())
        assert count == n * 400
        assert total == sum(vs[-1] - v for vs in by_choice.values() for v in vs)
        versions = by_choice[0]
        if versions[-1] == version and versions[0] < version:
            assert total == sum(v < version for vs in by_choice.values() for v in vs) > 0  # one version behind each
            return
    pytest.fail("the generation never spanned the update")


# ---- without a server ---------------------------------------------------------------------------------------------
class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)


class _Unstamped:
    """An engine whose events carry no timestamps (the vLLM backend's): choice 0 runs on versions 3, 3, 4, 4, 4."""

    tokenizer, version = _Tok(), 4

    async def generate(self, rid, prompt_ids, params, stream=True, **gate):
        for k, v in enumerate([3, 3, 4, 4, 4]):
            await asyncio.sleep(0.01)
            yield TokenEvent(0, k + 1, -0.5, v, None, "length" if k == 4 else None)

    def abort(self, rid):
        pass

    def stats(self):
        return {"running": 0, "version": self.version}


def test_generation_timings_without_engine_stamps_and_one_registry_per_app():
    engine = _Unstamped()
    metrics, other = ServerMetrics(engine), ServerMetrics(engine)

    async def run() -> Generation:
        gen = Generation(engine, [1, 2], SamplingParams(max_tokens=5), [], 1, want_text=False,
                         arrival=time.monotonic(), metrics=metrics)
        async for _ in gen.events():
            pass
        return gen

    gen = asyncio.run(run())
    assert gen.scheduled is None and gen.first_token is not None and gen.ended is not None
    assert gen.arrival < gen.first_token < gen.ended and gen.choices[0].final_version == 4
    m = {f.name: {s.name: s.value for s in f.samples} for f in text_string_to_metric_families(metrics.text())}
    assert m["inflight_request_queue_time_seconds"]["inflight_request_queue_time_seconds_count"] == 0  # no stamp
    assert m["inflight_time_to_first_token_seconds"]["inflight_time_to_first_token_seconds_count"] == 1
    assert m["inflight_e2e_request_latency_seconds"]["inflight_e2e_request_latency_seconds_count"] == 1
    tpot = m["inflight_time_per_output_token_seconds"]
    assert tpot["inflight_time_per_output_token_seconds_count"] == 1
    assert 0.005 < tpot["inflight_time_per_output_token_seconds_sum"] < 5  # 4 gaps of ~10 ms each, averaged
    lag = m["inflight_served_token_policy_lag_versions"]
    assert lag["inflight_served_token_policy_lag_versions_count"] == 5
    assert lag["inflight_served_token_policy_lag_versions_sum"] == 2  # two tokens of version 3, ended at 4
    assert m["inflight_weight_version"]["inflight_weight_version"] == 4
    o = {f.name: {s.name: s.value for s in f.samples} for f in text_string_to_metric_families(other.text())}
    assert o["inflight_time_to_first_token_seconds"]["inflight_time_to_first_token_seconds_count"] == 0
