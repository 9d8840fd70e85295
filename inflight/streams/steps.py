"""StepReader: the trainer side of the stream, one optimizer step (exactly `groups_per_step` groups) at a time.

    reader = StepReader(stream, groups_per_step)
    while not stop:
        groups = reader.next_step(timeout_s=1.0)
        if groups is None:
            continue                  # not enough groups yet; check `stop` and wait again
        ... train on groups, optimizer step, publish_version ...
        stream.ack(reader.position)   # a restarted consumer resumes from here

It never reads past the step it assembles, so `position` (groups read so far) is exactly the end of the last step
returned. A timeout keeps the groups read so far for the next call: nothing is dropped.
"""

from __future__ import annotations

import time

from inflight.contracts import Group, Stream


class StepReader:
    def __init__(self, stream: Stream, groups_per_step: int):
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        capacity = getattr(stream, "capacity", groups_per_step)
        if capacity < groups_per_step:  # Redis keeps a step's groups until its ack: a smaller bound deadlocks
            raise ValueError(f"stream capacity {capacity} < groups_per_step {groups_per_step}")
        self.stream, self.groups_per_step = stream, groups_per_step
        self._partial: list[Group] = []

    def next_step(self, timeout_s: float | None = None) -> list[Group] | None:
        """The next `groups_per_step` groups, oldest first; None when timeout_s passes before they are all there."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(self._partial) < self.groups_per_step:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self._partial += self.stream.get(self.groups_per_step - len(self._partial), timeout_s=left)
        step, self._partial = self._partial, []
        return step

    @property
    def position(self) -> int:
        """Groups read from the stream up to the end of the last full step returned (what to ack after it)."""
        return self.stream.consumed - len(self._partial)
