"""Groups back in the order they were started (AReaL's "oldest first"), whatever order they finish in.

The actor starts group k only while k < (trainer_version + max_lag + 1) * groups_per_step. If the trainer takes
groups in start order, optimizer step s (trained on weights s-1) holds groups k in [(s-1)B, sB), which were
started at a version >= s-1-max_lag, so no trained token lags by more than max_lag. Taking them in completion
order instead would let a slow early group slip into a later step with a larger lag.

Groups carry their start index in `sample.meta["group_index"]` (set by the actor). A missing index is a group the
actor gave up on (a failed group frees its slot for a fresh prompt with a new index) once the trainer holds every
group the actor may have started: taken + buffered == live_cap = min(the actor's bound at the version published, its
limit), the bound being (version + max_lag + 1 + queue_ahead if gated) * B (inflight/config/limits.py). Then nothing
else is in flight and the index is skipped; `hole_timeout_s` is the last resort. Groups without an index keep their
arrival order.

Dynamic sampling (algo/dynamic_sampling.py): a group the actor dropped (rewards all equal) arrives marked and is
passed over in its place, never returned: it gave its slot back, so it counts neither as taken nor toward the live
groups the cap compares with; `passed` lists (index, the model's tokens) of those passed over since `pop_passed`.
"""

from __future__ import annotations

import time

from inflight.algo.dynamic_sampling import is_dropped, model_tokens
from inflight.contracts import Group


def group_index(group: Group) -> int | None:
    idx = group[0].meta.get("group_index") if group else None
    return int(idx) if idx is not None else None


class StartOrder:
    def __init__(self, hole_timeout_s: float = 300.0):
        self.hole_timeout_s = hole_timeout_s
        self.buffer: dict[int, Group] = {}
        self.next_index = 0
        self._unindexed: list[Group] = []
        self._waiting_since: float | None = None
        self.skipped: list[int] = []
        self.taken = 0  # groups returned (indexed): trained
        self.dropped = 0  # indexed dropped groups passed over, in all (below next_index, like `skipped`)
        self.passed: list[tuple[int, int]] = []  # (index, model tokens) of dropped groups since pop_passed

    def pop_passed(self) -> list[tuple[int, int]]:
        out, self.passed = self.passed, []
        return out

    def _live_buffered(self) -> int:
        return sum(not is_dropped(g) for g in self.buffer.values())

    @property
    def live(self) -> int:
        """Groups held that will be trained (dropped ones excluded)."""
        return len(self._unindexed) + self._live_buffered()

    def add(self, groups: list[Group]) -> None:
        for g in groups:
            k = group_index(g)
            if k is None:
                if is_dropped(g):
                    self.passed.append((-1, model_tokens(g)))
                else:
                    self._unindexed.append(g)
            elif k < self.next_index or k in self.buffer:
                continue  # a duplicate (at-least-once delivery) of a group already taken
            else:
                self.buffer[k] = g

    def __len__(self) -> int:
        return len(self.buffer) + len(self._unindexed)

    def take(self, max_groups: int, live_cap: int | None = None, now: float | None = None) -> list[Group]:
        """Up to max_groups groups that are next in start order (never skipping an index still expected).
        `live_cap`: how many live groups the actor may have started by now (see the module docstring)."""
        now = time.monotonic() if now is None else now
        out: list[Group] = []
        while len(out) < max_groups and self._unindexed:
            out.append(self._unindexed.pop(0))
        while len(out) < max_groups:
            if self.next_index in self.buffer:
                g = self.buffer.pop(self.next_index)
                if is_dropped(g):
                    self.dropped += 1
                    self.passed.append((self.next_index, model_tokens(g)))
                else:
                    out.append(g)
                    self.taken += 1
                self.next_index += 1
                self._waiting_since = None
                continue
            if not self.buffer:
                break
            # the next group is missing while later ones wait: slow, or given up by the actor
            self._waiting_since = self._waiting_since if self._waiting_since is not None else now
            all_here = live_cap is not None and self.taken + self._live_buffered() >= live_cap
            if not all_here and now - self._waiting_since < self.hole_timeout_s:
                break
            self.skipped.append(self.next_index)
            self.next_index = min(k for k in self.buffer if k > self.next_index)
            self._waiting_since = None
        return out
