"""The actor -> trainer stream: `MemoryStream` (one host, between processes) and `RedisStream` (across hosts).

    stream = make_stream(cfg.pipeline, name=cfg.name, capacity=staleness(cfg).stream_capacity)  # config/limits.py

Create it in the launcher and pass the object to the actor and trainer processes (multiprocessing "spawn"
args); both kinds pickle for that. For Redis, call `stream.reset()` first when the run starts fresh.
The actor calls the blocking `put` through `asyncio.to_thread`; the trainer reads groups with `get` and acks
what its optimizer steps used (trainer/loop/trainer_loop.py).
"""

from __future__ import annotations

from typing import Any, Protocol

from inflight.streams.memory import MemoryStream, StreamClosed
from inflight.streams.redis_stream import RedisStream
from inflight.streams.serialize import SerializationError, decode_group, encode_group

__all__ = [
    "MemoryStream", "RedisStream", "StreamClosed", "SerializationError", "encode_group", "decode_group",
    "StreamSettings", "make_stream",
]


class StreamSettings(Protocol):
    """The two settings a stream needs (`pipeline.stream`, `pipeline.redis_url` of the run's config)."""

    stream: str  # memory | redis
    redis_url: str


def make_stream(
    pipeline_cfg: StreamSettings, *, name: str = "inflight", capacity: int = 1024, ctx: Any = None
) -> MemoryStream | RedisStream:
    """`pipeline.stream`: memory (default) | redis (at `pipeline.redis_url`, keys under `name`).
    `capacity` bounds the groups held (memory: not yet read; redis: not yet acked). `ctx`: the multiprocessing
    context the children are started with (default "spawn")."""
    kind = pipeline_cfg.stream
    if kind == "memory":
        return MemoryStream(capacity=capacity, ctx=ctx)
    if kind == "redis":
        return RedisStream(url=pipeline_cfg.redis_url, name=name, capacity=capacity)
    raise ValueError(f"unknown pipeline.stream '{kind}': choose 'memory' or 'redis'")
