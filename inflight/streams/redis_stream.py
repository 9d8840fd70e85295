"""RedisStream: actor -> trainer through a Redis Stream, for when they run on different hosts.

Keys (all under `name`, e.g. the run name):
  {name}:groups    the Redis Stream; one entry per group, field `g` = msgpack bytes (serialize.py)
  {name}:produced  groups ever added (INCRBY with the XADDs)
  {name}:consumer  hash: `acked_id`/`acked` = last acknowledged entry id / position, `consumed` = groups read
  {name}:version   the weight version the trainer published

One consumer (trainer rank 0) reads with XREAD after the last entry it has seen. `ack(position)` stores the id of
that entry and trims (XTRIM MINID) every entry up to it, in one transaction. A consumer that restarts (a new
RedisStream object, in any process) resumes right after its last ack: entries read but not acked are delivered
again (nothing lost), acked ones never (nothing trained twice when it acks after use).

Bounded: entries not yet acked stay in Redis; `put` waits while `capacity` of them are there (several producers
may overshoot by one batch). The consumer must ack at least every `capacity` groups, or the producer waits
forever; ack after each optimizer step and keep capacity >= 2 x groups_per_step.

The object pickles as (url, name, capacity): pass it to a spawned child, which opens its own connection.
Call `reset()` once at the start of a fresh run (the launcher) to drop what a previous run with that name left.
"""

from __future__ import annotations

import collections
import time
from typing import Any, cast

import redis

from inflight.contracts import Group
from inflight.streams.memory import StreamClosed
from inflight.streams.serialize import SerializationError, decode_group, encode_group

_POLL_S = 0.02  # producer re-checks for room at this interval while the stream is full


def _next_id(entry_id: str) -> str:
    """The smallest stream id after `entry_id` ('ms-seq' -> 'ms-(seq+1)')."""
    ms, seq = entry_id.split("-")
    return f"{ms}-{int(seq) + 1}"


class RedisStream:
    """Redis Streams transport; implements contracts.Stream."""

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", name: str = "inflight", capacity: int = 1024):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 group, got {capacity}")
        self.url, self.name, self.capacity = url, name, capacity
        self._r = redis.Redis.from_url(url, decode_responses=False)
        self._key = f"{name}:groups"
        self._produced_key = f"{name}:produced"
        self._consumer_key = f"{name}:consumer"
        self._version_key = f"{name}:version"
        self._closed = False
        # consumer state, loaded from Redis on first consumer use
        self._loaded = False
        self._last_id = "0-0"  # last entry delivered to this consumer
        self._consumed = 0
        self._acked = 0
        self._unacked: collections.deque[tuple[int, str]] = collections.deque()  # (position after entry, id)

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "name": self.name, "capacity": self.capacity}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def reset(self) -> None:
        """Delete everything stored under this name (start of a fresh run)."""
        self._r.delete(self._key, self._produced_key, self._consumer_key, self._version_key)
        self._loaded = False

    # ---- producer (actor) ----
    def put(self, groups: list[Group]) -> None:
        """Append groups in order; waits while `capacity` un-acked groups are stored."""
        blobs = [encode_group(g) for g in groups]  # a bad group fails before any is sent
        while blobs:
            if self._closed:
                raise StreamClosed("stream closed")
            room = self.capacity - self._r.xlen(self._key)
            if room <= 0:
                time.sleep(_POLL_S)
                continue
            batch, blobs = blobs[:room], blobs[room:]
            pipe = self._r.pipeline(transaction=True)
            for blob in batch:
                pipe.xadd(self._key, {b"g": blob})
            pipe.incrby(self._produced_key, len(batch))
            pipe.execute()

    # ---- consumer (trainer) ----
    def _load(self) -> None:
        if self._loaded:
            return
        h = cast(dict[bytes, bytes], self._r.hgetall(self._consumer_key))  # decode_responses=False: bytes
        self._last_id = h.get(b"acked_id", b"0-0").decode()
        self._acked = self._consumed = int(h.get(b"acked", 0))
        self._unacked.clear()
        self._r.hset(self._consumer_key, "consumed", self._consumed)  # un-acked reads will come again
        self._loaded = True

    def get(self, max_groups: int, timeout_s: float | None = None) -> list[Group]:
        """Wait up to timeout_s (None = forever) for at least one group after the last one read, then return up
        to max_groups, oldest first. An empty list means the timeout passed."""
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        self._load()
        block = 0 if timeout_s is None else (max(1, int(timeout_s * 1000)) if timeout_s > 0 else None)
        # RESP2 (the client's protocol): [[key, [(id, {field: value}), ...]]]; redis-py types every protocol's shape
        reply = cast(list[list[Any]], self._r.xread({self._key: self._last_id}, count=max_groups, block=block))
        if not reply:
            return []
        groups: list[Group] = []
        for raw_id, fields in reply[0][1]:
            entry_id = raw_id.decode()
            try:
                groups.append(decode_group(fields[b"g"]))
            except (SerializationError, KeyError) as exc:
                raise SerializationError(f"stream {self._key} entry {entry_id}: {exc}") from exc
            self._consumed += 1
            self._last_id = entry_id
            self._unacked.append((self._consumed, entry_id))
        self._r.hset(self._consumer_key, "consumed", self._consumed)
        return groups

    def ack(self, position: int) -> None:
        """The first `position` groups read by this consumer are used: store the position, free their memory."""
        self._load()
        if position > self._consumed:
            raise ValueError(f"ack({position}) beyond what was consumed ({self._consumed})")
        entry_id = None
        while self._unacked and self._unacked[0][0] <= position:
            entry_id = self._unacked.popleft()[1]
        if entry_id is None:
            return  # already acked
        pipe = self._r.pipeline(transaction=True)
        pipe.hset(self._consumer_key, mapping={"acked_id": entry_id, "acked": position})
        pipe.xtrim(self._key, minid=_next_id(entry_id), approximate=False)
        pipe.execute()
        self._acked = position

    @property
    def produced(self) -> int:
        return int(self._r.get(self._produced_key) or 0)

    @property
    def consumed(self) -> int:
        """Groups read by the consumer (after a restart: from its last ack). Also readable from the producer."""
        if self._loaded:
            return self._consumed
        return int(self._r.hget(self._consumer_key, "consumed") or 0)

    @property
    def acked(self) -> int:
        if self._loaded:
            return self._acked
        return int(self._r.hget(self._consumer_key, "acked") or 0)

    def pending(self) -> int:
        """Groups stored and not yet acked."""
        return int(self._r.xlen(self._key))

    # ---- weight version ----
    def publish_version(self, version: int) -> None:
        self._r.set(self._version_key, int(version))

    def trainer_version(self) -> int:
        v = self._r.get(self._version_key)
        return -1 if v is None else int(v)

    def close(self) -> None:
        """A producer waiting for room raises StreamClosed; the connection pool is released."""
        self._closed = True
        self._r.close()

    @property
    def closed(self) -> bool:
        return self._closed
