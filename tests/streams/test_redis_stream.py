"""RedisStream against a real redis-server: processes, order, restart from the last ack, bound, versions."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time

import pytest
import redis
from streamdata import make_group, same_group

from inflight.config.pipeline import PipelineConfig
from inflight.streams import RedisStream, SerializationError, make_stream

CTX = mp.get_context("spawn")


def _produce(stream, start: int, stop: int, batch: int) -> None:
    for i in range(start, stop, batch):
        stream.put([make_group(k) for k in range(i, min(i + batch, stop))])


def _consume_then_crash(stream, read: int, ack_at: int, out) -> None:
    """Read `read` groups, ack the first `ack_at`, then die without acking the rest."""
    ids = []
    while len(ids) < read:
        ids += [g[0].group_id for g in stream.get(max_groups=read - len(ids), timeout_s=30)]
    stream.ack(ack_at)
    stream.publish_version(3)
    out.put(ids)
    out.close()
    out.join_thread()  # flush, then die abruptly: no clean-up code runs
    os._exit(0)


def _wait(cond, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture
def stream(redis_url, request):
    s = RedisStream(redis_url, name=request.node.name, capacity=64)
    s.reset()
    yield s
    s.close()


def test_round_trip_between_processes_in_order(stream):
    n = 90
    producer = CTX.Process(target=_produce, args=(stream, 0, n, 8))
    producer.start()
    got = []
    while len(got) < n:
        batch = stream.get(max_groups=16, timeout_s=30)
        assert batch, "timed out"
        got.extend(batch)
        stream.ack(stream.consumed)
    producer.join(30)
    assert producer.exitcode == 0
    assert [g[0].group_id for g in got] == [f"g{i}" for i in range(n)]
    assert all(same_group(make_group(i), g) for i, g in enumerate(got))
    assert stream.produced == n and stream.consumed == n and stream.acked == n
    assert stream.pending() == 0  # acked entries are trimmed from Redis
    assert stream.get(max_groups=4, timeout_s=0.05) == []


def test_consumer_restart_resumes_after_last_ack(stream):
    n = 30
    _produce(stream, 0, n, 30)
    out = CTX.Queue()
    first = CTX.Process(target=_consume_then_crash, args=(stream, 12, 7, out))
    first.start()
    read_first = out.get(timeout=60)
    first.join(30)
    assert read_first == [f"g{i}" for i in range(12)]
    assert stream.trainer_version() == 3  # published by the other process

    restarted = RedisStream(stream.url, name=stream.name, capacity=64)  # a fresh consumer, as after a crash
    assert restarted.acked == 7
    rest = restarted.get(max_groups=2, timeout_s=5)
    assert restarted.consumed == 9 and stream.consumed == 9  # counted again from the last ack
    while len(rest) < n - 7:
        rest += restarted.get(max_groups=50, timeout_s=5)
    ids = [g[0].group_id for g in rest]
    assert ids == [f"g{i}" for i in range(7, n)]  # un-acked g7..g11 come again, g0..g6 never
    assert all(same_group(make_group(7 + i), g) for i, g in enumerate(rest))
    assert restarted.consumed == n
    restarted.ack(20)
    assert stream.pending() == n - 20
    again = RedisStream(stream.url, name=stream.name)
    assert [g[0].group_id for g in again.get(3, timeout_s=5)] == ["g20", "g21", "g22"]


def test_producer_waits_for_acks_when_full(redis_url):
    cap, n = 5, 12
    stream = RedisStream(redis_url, name="bounded", capacity=cap)
    stream.reset()
    producer = CTX.Process(target=_produce, args=(stream, 0, n, 3))
    producer.start()
    _wait(lambda: stream.produced == cap)
    time.sleep(0.5)
    assert stream.produced == cap and stream.pending() == cap and producer.is_alive()
    got = stream.get(max_groups=cap, timeout_s=10)
    time.sleep(0.3)
    assert stream.produced == cap  # reading alone frees nothing: un-acked entries are kept for a restart
    stream.ack(2)
    _wait(lambda: stream.produced == cap + 2)
    while len(got) < n:
        got += stream.get(max_groups=n, timeout_s=10)
        stream.ack(stream.consumed)
    producer.join(30)
    assert producer.exitcode == 0
    assert [g[0].group_id for g in got] == [f"g{i}" for i in range(n)]


def test_version_and_factory(redis_url):
    s = make_stream(PipelineConfig(stream="redis", redis_url=redis_url), name="factory", capacity=8)
    assert isinstance(s, RedisStream)
    s.reset()
    assert s.trainer_version() == -1
    s.publish_version(0)
    clone = pickle.loads(pickle.dumps(s))  # what spawn does when the launcher hands it to a child
    assert clone.trainer_version() == 0 and clone.capacity == 8 and clone.name == "factory"
    clone.publish_version(5)
    assert s.trainer_version() == 5


def test_corrupt_entry_is_a_clear_error(redis_url):
    s = RedisStream(redis_url, name="corrupt")
    s.reset()
    redis.Redis.from_url(redis_url).xadd("corrupt:groups", {b"g": b"\x80\x04not msgpack"})
    with pytest.raises(SerializationError, match="corrupt:groups entry"):
        s.get(1, timeout_s=1)
