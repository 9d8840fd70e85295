"""ServerPool against real HTTP servers: least-outstanding routing, per-server limit, retries, 4xx, dead servers."""

from __future__ import annotations

import asyncio

import pytest

from inflight.actor import BadRequest, RequestFailed, ResponseError, ServerPool
from inflight.actor.response_parsers import parse_builtin, parse_vllm
from tests.actor.helpers import ScriptedServer, free_port

PAYLOAD = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2, "logprobs": True}


def test_routing_balances_and_respects_concurrency_limit():
    with ScriptedServer(delay=0.15) as a, ScriptedServer(delay=0.15) as b:

        async def main():
            pool = ServerPool([a.url, b.url], concurrency_per_server=3, retries=0)
            try:
                outs = await asyncio.gather(*(pool.chat(PAYLOAD) for _ in range(14)))
            finally:
                await pool.aclose()
            return outs

        outs = asyncio.run(main())
    assert len(outs) == 14 and all(len(o) == 2 for o in outs)
    assert a.calls + b.calls == 14 and min(a.calls, b.calls) >= 3
    assert a.peak == 3 and b.peak == 3  # the per-server limit is reached, never exceeded


def test_least_outstanding_splits_a_burst_evenly():
    with ScriptedServer(delay=0.1) as a, ScriptedServer(delay=0.1) as b, ScriptedServer(delay=0.1) as c:

        async def main():
            pool = ServerPool([a.url, b.url, c.url], concurrency_per_server=100)
            try:
                await asyncio.gather(*(pool.chat(PAYLOAD) for _ in range(9)))
            finally:
                await pool.aclose()

        asyncio.run(main())
    assert (a.calls, b.calls, c.calls) == (3, 3, 3) and a.peak == b.peak == c.peak == 3


def test_completions_read_exactly_as_returned():
    with ScriptedServer() as a:

        async def main():
            pool = ServerPool([a.url])
            try:
                return await pool.chat(PAYLOAD)
            finally:
                await pool.aclose()

        cs = asyncio.run(main())
    assert [c.token_ids for c in cs] == [[10, 11], [11, 11]]
    assert all(c.prompt_ids == [1, 2, 3] and c.logprobs == [-0.5, -1.5] and c.versions == [7, 7] for c in cs)
    assert [c.text for c in cs] == ["c0", "c1"]


def test_5xx_retried_with_backoff_then_succeeds_or_fails():
    with ScriptedServer(fail_first=2) as a:

        async def main(retries):
            pool = ServerPool([a.url], retries=retries, backoff_s=0.01)
            try:
                return await pool.chat(PAYLOAD)
            finally:
                await pool.aclose()

        assert len(asyncio.run(main(2))) == 2
        assert a.calls == 3
        a.calls, a.fail_first = 0, 5
        with pytest.raises(RequestFailed, match="3 attempts"):
            asyncio.run(main(2))
        assert a.calls == 3


def test_4xx_is_not_retried():
    with ScriptedServer(status=400) as a:

        async def main():
            pool = ServerPool([a.url], retries=4, backoff_s=0.01)
            try:
                return await pool.chat(PAYLOAD)
            finally:
                await pool.aclose()

        with pytest.raises(BadRequest, match="HTTP 400"):
            asyncio.run(main())
        assert a.calls == 1


def test_dead_server_leaves_rotation_and_comes_back_after_probe():
    dead_port = free_port()
    with ScriptedServer(delay=0.02) as live:

        async def main():
            pool = ServerPool([f"http://127.0.0.1:{dead_port}", live.url], retries=3, backoff_s=0.01,
                              probe_interval_s=0.05)
            try:
                outs = await asyncio.gather(*(pool.chat(PAYLOAD) for _ in range(6)))
                assert not pool.servers[0].healthy and pool.servers[1].healthy
                assert pool.servers[0].completed == 0 and pool.servers[1].completed == 6
                with ScriptedServer(port=dead_port) as revived:
                    for _ in range(200):  # the probe finds it back
                        if pool.servers[0].healthy:
                            break
                        await asyncio.sleep(0.05)
                    assert pool.servers[0].healthy
                    await asyncio.gather(*(pool.chat(PAYLOAD) for _ in range(4)))
                    assert revived.calls == 2  # back in rotation: least outstanding splits 2/2
                return outs
            finally:
                await pool.aclose()

        assert len(asyncio.run(main())) == 6


def test_timeout_takes_server_out_and_request_goes_elsewhere():
    with ScriptedServer(delay=1.5) as slow, ScriptedServer() as fast:

        async def main():
            pool = ServerPool([slow.url, fast.url], request_timeout_s=0.3, retries=2, backoff_s=0.01,
                              probe_interval_s=60)
            try:
                outs = await asyncio.gather(*(pool.chat(PAYLOAD) for _ in range(2)))
                return outs, pool.servers[0].healthy
            finally:
                await pool.aclose()

        outs, slow_healthy = asyncio.run(main())
    assert len(outs) == 2 and not slow_healthy and fast.calls == 2


def test_adapters_reject_inconsistent_responses():
    choice = {"index": 0, "message": {"content": "x"}, "finish_reason": "length", "token_ids": [1, 2],
              "prompt_token_ids": [5], "token_versions": [0, 1], "logprobs": {"content": [{"logprob": -1.0}]}}
    with pytest.raises(ResponseError, match="2 token_ids, 1 logprobs"):
        parse_builtin({"choices": [choice]})
    with pytest.raises(ResponseError, match="extension fields"):
        parse_builtin({"choices": [{**choice, "token_versions": None}]})
    with pytest.raises(ResponseError, match="no choices"):
        parse_builtin({"choices": []})
    ok = {**choice, "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -2.0}]}}
    (c,) = parse_builtin({"choices": [ok]})
    assert (c.token_ids, c.versions, c.finish_reason) == ([1, 2], [0, 1], "length")
    vllm = {"prompt_token_ids": [5], "choices": [{k: v for k, v in ok.items() if k not in
                                                  ("prompt_token_ids", "token_versions")}]}
    (v,) = parse_vllm({**vllm, "weight_version": 3})
    assert v.prompt_ids == [5] and v.versions == [3, 3]


def test_groups_that_cannot_complete_are_reported_and_counted():
    """No server at all: every group fails, each one is counted and reported with its error, none is delivered."""
    import multiprocessing as mp

    from inflight.actor import Actor, ActorConfig
    from inflight.rewards import RewardService
    from inflight.streams import MemoryStream
    from inflight.tasks import TaskConfig, get_task

    task_cfg = TaskConfig(eval_size=4)
    stream = MemoryStream(capacity=16, ctx=mp.get_context("spawn"))
    cfg = ActorConfig(group_size=2, groups_per_step=2, retries=1, backoff_s=0.01, request_timeout_s=0.3)

    async def main():
        pool = ServerPool([f"http://127.0.0.1:{free_port()}"], retries=1, backoff_s=0.01, request_timeout_s=0.3,
                          probe_interval_s=60)
        actor = Actor(cfg, get_task(task_cfg), pool, RewardService(task_cfg), stream)  # rewards never reached
        try:
            with pytest.raises(RuntimeError, match="groups failed"):
                await actor.generate_round(2)
            return actor
        finally:
            await pool.aclose()

    actor = asyncio.run(main())
    assert actor.metrics.groups_failed == 4 and actor.metrics.groups_completed == 0
    assert len(actor.failures) == 4 and all("RequestFailed" in f["error"] for f in actor.failures)
    assert [f["group_index"] for f in actor.failures] == [0, 1, 2, 3] and stream.produced == 0


def test_429_queue_full_is_retried_not_fatal():
    with ScriptedServer(status=429) as a:

        async def main():
            pool = ServerPool([a.url], retries=2, backoff_s=0.01)
            try:
                return await pool.chat(PAYLOAD)
            finally:
                await pool.aclose()

        with pytest.raises(RequestFailed, match="3 attempts") as err:
            asyncio.run(main())
        assert not isinstance(err.value, BadRequest) and a.calls == 3
