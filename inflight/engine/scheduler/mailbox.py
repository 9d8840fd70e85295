"""Hands the engine thread's token events to the consumers' asyncio loops, one wake-up per loop at a time.

While a loop has not yet run the previous hand-over, new events join it: a busy consumer then wakes once per several
tokens instead of once per token (each request's queue receives lists of events, in order)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class Mailbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._boxes: dict[asyncio.AbstractEventLoop, dict[Any, list]] = {}  # loop -> {queue: events} not yet handed over

    def send(self, out: dict[Any, list]) -> None:
        """Engine thread: `out` maps each request (with .loop and .queue) to its new events."""
        wake = []
        with self._lock:
            for req, events in out.items():
                box = self._boxes.get(req.loop)
                if box is None:
                    box = self._boxes[req.loop] = {}
                    wake.append(req.loop)
                box.setdefault(req.queue, []).extend(events)
        for loop in wake:
            try:
                loop.call_soon_threadsafe(self._deliver, loop)
            except RuntimeError:  # the consumer's loop is closed
                with self._lock:
                    self._boxes.pop(loop, None)

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:  # runs on the consumer's loop
        with self._lock:
            box = self._boxes.pop(loop, {})
        for queue, events in box.items():
            queue.put_nowait(events)
