"""MemoryStream between real processes (multiprocessing "spawn", as the launcher starts actor and trainer)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
from streamdata import make_group, same_group

from inflight.config.pipeline import PipelineConfig
from inflight.streams import MemoryStream, StreamClosed, make_stream

CTX = mp.get_context("spawn")


def _produce(stream, start: int, stop: int, batch: int) -> None:
    for i in range(start, stop, batch):
        stream.put([make_group(k) for k in range(i, min(i + batch, stop))])


def _publish_versions(stream, versions: list[int]) -> None:
    for v in versions:
        stream.publish_version(v)


def _wait(cond, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_round_trip_between_processes_in_order():
    stream = make_stream(PipelineConfig(stream="memory"), capacity=16)
    assert isinstance(stream, MemoryStream)
    n = 120
    producer = CTX.Process(target=_produce, args=(stream, 0, n, 7))
    producer.start()
    got = []
    while len(got) < n:
        batch = stream.get(max_groups=10, timeout_s=60)
        assert batch, "timed out waiting for groups"
        assert len(batch) <= 10
        got.extend(batch)
    producer.join(30)
    assert producer.exitcode == 0
    assert [g[0].group_id for g in got] == [f"g{i}" for i in range(n)]  # FIFO, nothing lost or repeated
    assert all(same_group(make_group(i), g) for i, g in enumerate(got))  # bit-exact content
    assert stream.produced == n and stream.consumed == n
    assert stream.get(max_groups=4, timeout_s=0.05) == []
    stream.ack(n)
    assert stream.acked == n
    with pytest.raises(ValueError):
        stream.ack(n + 1)


def test_version_published_by_another_process():
    stream = MemoryStream(capacity=4, ctx=CTX)
    assert stream.trainer_version() == -1
    p = CTX.Process(target=_publish_versions, args=(stream, [0, 1, 2, 7]))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    assert stream.trainer_version() == 7


def test_producer_blocks_when_full():
    cap, n = 4, 12
    stream = MemoryStream(capacity=cap, ctx=CTX)
    producer = CTX.Process(target=_produce, args=(stream, 0, n, 1))
    producer.start()
    _wait(lambda: stream.produced == cap)
    time.sleep(0.5)  # give a non-blocking producer time to overrun the bound
    assert stream.produced == cap and producer.is_alive()
    got = stream.get(max_groups=2, timeout_s=30)
    assert [g[0].group_id for g in got] == ["g0", "g1"]
    _wait(lambda: stream.produced == cap + 2)  # room for exactly two more
    time.sleep(0.3)
    assert stream.produced == cap + 2
    while len(got) < n:
        got += stream.get(max_groups=n, timeout_s=30)
    producer.join(30)
    assert producer.exitcode == 0
    assert [g[0].group_id for g in got] == [f"g{i}" for i in range(n)]


def test_close_wakes_a_blocked_producer():
    stream = MemoryStream(capacity=1, ctx=CTX)
    stream.put([make_group(0)])
    import threading
    err = []
    t = threading.Thread(target=lambda: err.append(pytest.raises(StreamClosed, stream.put, [make_group(1)])))
    t.start()
    time.sleep(0.2)
    assert t.is_alive()
    stream.close()
    t.join(5)
    assert not t.is_alive() and err
    assert [g[0].group_id for g in stream.get(5, timeout_s=1)] == ["g0"]  # queued groups still drain
    assert stream.get(5, timeout_s=1) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="capacity"):
        MemoryStream(capacity=0)
    with pytest.raises(ValueError, match="unknown pipeline.stream"):
        make_stream(PipelineConfig(stream="kafka"))
    with pytest.raises(ValueError, match="max_groups"):
        MemoryStream(capacity=2).get(0)
