"""MemoryStream: actor -> trainer on one host, between processes, through a bounded multiprocessing queue.

Create it in the parent (the launcher) and pass the object itself as an argument of the child processes; it
pickles only while a process is being spawned (multiprocessing's rule for queues and shared values):

    ctx = multiprocessing.get_context("spawn")
    stream = MemoryStream(capacity=256, ctx=ctx)
    ctx.Process(target=actor_main, args=(cfg, stream)).start()
    ctx.Process(target=trainer_main, args=(cfg, stream)).start()

Each queue item is one group already encoded with msgpack (`serialize.py`), so what crosses the pipe is plain
bytes. One producer keeps FIFO order (several producers interleave, each in its own order). `put` blocks while
`capacity` groups wait to be read: memory stays bounded and a slow trainer slows the actor. `put` is blocking;
an asyncio actor calls it through `asyncio.to_thread`.

Delivery is at-most-once across a consumer crash: a group read but not yet used dies with the consumer process
(`ack` only records the position). Use RedisStream when a restarted consumer must resume from its last ack.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from typing import Any

from inflight.contracts import Group
from inflight.streams.serialize import decode_group, encode_group

_POLL_S = 0.05  # how often a blocked put re-checks that the stream is not closed


class StreamClosed(RuntimeError):
    """The stream was closed while a producer waited for room."""


class MemoryStream:
    """Bounded inter-process FIFO of groups; implements contracts.Stream."""

    def __init__(self, capacity: int = 1024, ctx: Any = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 group, got {capacity}")
        ctx = ctx or mp.get_context("spawn")
        self.capacity = capacity
        self._q = ctx.Queue(maxsize=capacity)
        self._produced = ctx.Value("q", 0)
        self._consumed = ctx.Value("q", 0)
        self._acked = ctx.Value("q", 0)
        self._version = ctx.Value("q", -1)
        self._closed = ctx.Event()

    # ---- producer (actor) ----
    def put(self, groups: list[Group]) -> None:
        """Append groups in order; blocks while the stream is full. Raises StreamClosed after close()."""
        for blob in [encode_group(g) for g in groups]:  # encode all first: a bad group fails before any is sent
            while True:
                if self._closed.is_set():
                    raise StreamClosed("stream closed")
                try:
                    self._q.put(blob, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            with self._produced.get_lock():
                self._produced.value += 1

    # ---- consumer (trainer) ----
    def get(self, max_groups: int, timeout_s: float | None = None) -> list[Group]:
        """Wait up to timeout_s (None = forever) for at least one group, then return up to max_groups of those
        already waiting, oldest first. An empty list means the timeout passed (or the stream was closed)."""
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        blobs: list[bytes] = []
        while not blobs:
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if wait <= 0:
                return []
            try:
                blobs.append(self._q.get(timeout=wait))
            except queue.Empty:
                if self._closed.is_set():  # groups still queued at close are drained first
                    return []
        while len(blobs) < max_groups:
            try:
                blobs.append(self._q.get_nowait())
            except queue.Empty:
                break
        with self._consumed.get_lock():
            self._consumed.value += len(blobs)
        return [decode_group(b) for b in blobs]

    def ack(self, position: int) -> None:
        """Record that the consumer has used the first `position` groups it read."""
        if position > self.consumed:
            raise ValueError(f"ack({position}) beyond what was consumed ({self.consumed})")
        with self._acked.get_lock():
            self._acked.value = max(self._acked.value, position)

    @property
    def produced(self) -> int:
        return self._produced.value

    @property
    def consumed(self) -> int:
        return self._consumed.value

    @property
    def acked(self) -> int:
        return self._acked.value

    def pending(self) -> int:
        """Groups put and not yet read (approximate while a put or get is under way)."""
        return self.produced - self.consumed

    # ---- weight version ----
    def publish_version(self, version: int) -> None:
        self._version.value = int(version)

    def trainer_version(self) -> int:
        return self._version.value

    # ---- shutdown ----
    def close(self) -> None:
        """Wake blocked producers/consumers with StreamClosed / []; let this process exit even if groups are
        still buffered for a consumer that is gone (they are dropped)."""
        self._closed.set()
        self._q.cancel_join_thread()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()
