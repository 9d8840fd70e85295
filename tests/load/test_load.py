"""The built-in server under load (loopback, bounded in count and time): a queue limit turns overload into clean
429 answers (never 5xx), admission slots come back however a request ends, and 1,000 concurrent streaming and
non-streaming requests of mixed lengths are each answered or cleanly rejected with bounded server memory."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from inflight.engine.serve import ServerProcess

ENV = {"OMP_NUM_THREADS": "1"}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


async def one(c: httpx.AsyncClient, model: str, i: int, stream: bool, max_tokens: int, n: int = 1,
              chat: bool = True) -> dict:
    """One request; returns status, latency, tokens received, and problems found in the answer."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": model, "max_tokens": max_tokens, "n": n, "ignore_eos": True, "stream": stream, "seed": i,
            **({"messages": [{"role": "user", "content": f"{i}+{i}="}]} if chat else {"prompt": f"{i}*2="})}
    t0 = time.perf_counter()
    out = {"status": 0, "tokens": 0, "problems": [], "stream": stream, "retry_after": None, "code": None}
    if stream:
        async with c.stream("POST", path, json=body) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode()
            else:
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                if not lines or lines[-1] != "data: [DONE]":
                    out["problems"].append("stream did not end with [DONE]")
                for line in lines[:-1]:
                    for ch in json.loads(line[6:])["choices"]:
                        out["tokens"] += len(ch.get("token_ids") or [])
                text = ""
    else:
        r = await c.post(path, json=body)
        out["status"], text = r.status_code, r.text
        if r.status_code == 200:
            out["tokens"] = sum(len(ch["token_ids"]) for ch in r.json()["choices"])
    if out["status"] == 200 and out["tokens"] != n * max_tokens:
        out["problems"].append(f"got {out['tokens']} tokens, asked {n} x {max_tokens}")
    if out["status"] == 429:
        out["code"] = json.loads(text)["error"]["code"]
        out["retry_after"] = r.headers.get("retry-after")
    out["latency"] = time.perf_counter() - t0
    return out


def test_queue_limit_answers_429_and_frees_slots(tiny_model_dir):
    with ServerProcess(str(tiny_model_dir), extra_args=["--max-batch", "2", "--max-waiting", "2",
                                                        "--max-model-len", "512"], env=ENV) as proc:
        model = httpx.get(proc.url + "/v1/models").json()["data"][0]["id"]

        async def burst(k: int, max_tokens: int) -> list[dict]:
            async with httpx.AsyncClient(base_url=proc.url, timeout=120) as c:
                return await asyncio.gather(*(one(c, model, i, stream=i % 2 == 0, max_tokens=max_tokens)
                                              for i in range(k)))

        results = asyncio.run(burst(12, 300))
        codes = sorted(r["status"] for r in results)
        assert set(codes) == {200, 429}, codes
        assert codes.count(200) >= 4  # the capacity: max_batch 2 + max_waiting 2
        for r in results:
            assert not r["problems"], r
            if r["status"] == 429:
                assert r["code"] == "queue_full" and r["retry_after"] == "1"
        assert metric(proc.url, "inflight_rejected_requests_total") == codes.count(429)
        # all slots are free again once the burst is over
        r = httpx.post(proc.url + "/v1/completions", json={"model": model, "prompt": "1", "n": 2, "max_tokens": 1})
        assert r.status_code == 200
        # clients that hang up mid-stream give their slots back
        for _ in range(4):
            with httpx.stream("POST", proc.url + "/v1/chat/completions", timeout=60, json={
                    "model": model, "messages": [{"role": "user", "content": "1"}], "max_tokens": 400,
                    "ignore_eos": True, "stream": True}) as s:
                for line in s.iter_lines():
                    if "token_ids" in line:
                        break
        deadline = time.monotonic() + 30
        while metric(proc.url, "inflight_running_requests") > 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        again = asyncio.run(burst(4, 3))  # exactly the capacity: all admitted
        assert [r["status"] for r in again] == [200] * 4, [(r["status"], r["code"]) for r in again]


@pytest.mark.slow
def test_thousand_concurrent_mixed_requests(tiny_model_dir):
    """Two waves of 1,000 concurrent requests (half streaming; chat and completions; max_tokens 1-128; n 1-2)
    against max_batch 16 + max_waiting 16 sequences (small, so that the engine queue fills on 2 shared cores, where
    the HTTP layer is otherwise the bottleneck). Every request gets 200 (complete) or 429; server RSS is measured
    before, after the first wave and after the second (a leak would grow it again)."""
    with ServerProcess(str(tiny_model_dir), extra_args=["--max-batch", "16", "--max-waiting", "16",
                                                        "--max-model-len", "256"], env=ENV) as proc:
        model = httpx.get(proc.url + "/v1/models").json()["data"][0]["id"]
        pid = proc.proc.pid

        async def wave(seed: int) -> tuple[list[dict], float]:
            rng = random.Random(seed)
            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
            async with httpx.AsyncClient(base_url=proc.url, limits=limits, timeout=300) as c:
                await one(c, model, 0, stream=False, max_tokens=2)  # warm path
                t0 = time.perf_counter()
                jobs = [one(c, model, i, stream=rng.random() < 0.5, max_tokens=rng.choice([1, 8, 32, 128]),
                            n=rng.choice([1, 1, 1, 2]), chat=rng.random() < 0.7) for i in range(1000)]
                results = await asyncio.gather(*jobs)
                return results, time.perf_counter() - t0

        rss0 = rss_mb(pid)
        stats = []
        rss = []
        for seed in (1, 2):
            results, wall = asyncio.run(wave(seed))
            rss.append(rss_mb(pid))
            codes = [r["status"] for r in results]
            assert set(codes) <= {200, 429}, sorted(set(codes))
            assert all(not r["problems"] for r in results), [r["problems"] for r in results if r["problems"]][:5]
            ok = sorted(r["latency"] for r in results if r["status"] == 200)
            tokens = sum(r["tokens"] for r in results)
            stats.append(dict(ok=len(ok), rejected=codes.count(429), wall_s=wall, tokens=tokens,
                              tok_per_s=tokens / wall, req_per_s=len(ok) / wall,
                              p50_s=ok[len(ok) // 2], p99_s=ok[int(len(ok) * 0.99) - 1]))
            # whether the engine's queue fills depends on how fast the HTTP layer feeds it on this machine (one CI
            # run answered all 1,000): the 429 path itself is pinned by test_queue_limit_answers_429_and_frees_slots
            assert len(ok) >= 32 and all(r["code"] == "queue_full" for r in results if r["status"] == 429)
        for i, s in enumerate(stats):
            print(f"wave {i + 1}: {s['ok']} answered, {s['rejected']} rejected (429) in {s['wall_s']:.1f} s; "
                  f"{s['tok_per_s']:.0f} generated tok/s, {s['req_per_s']:.1f} answered req/s, "
                  f"latency p50 {s['p50_s']:.2f} s, p99 {s['p99_s']:.2f} s")
        print(f"server RSS: {rss0:.0f} MB before, {rss[0]:.0f} MB after wave 1, {rss[1]:.0f} MB after wave 2")
        assert metric(proc.url, "inflight_running_requests") == 0
        assert rss[0] - rss0 < 300  # bounded by the admission limit, not by the number of clients
        assert rss[1] - rss[0] < 60  # the second wave does not grow it again (no per-request leak)
