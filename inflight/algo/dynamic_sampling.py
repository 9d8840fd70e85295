"""DAPO's dynamic sampling with refill (Yu et al. 2025, "DAPO", section 3.2): the actor drops, the trainer passes over.

A group whose G rewards are all equal has zero advantage everywhere: it carries no learning signal, and training it
only shrinks the step. With `actor.dynamic_sampling` the actor drops such a group and gives its place back, exactly
as it does for a failed group: its bound counts live groups (started - failed - dropped), so a fresh prompt is
started in its place while the bound allows. The dropped group still goes into the stream, marked
(`meta["dropped"]`), so the trainer passes over it in start order without waiting for it (trainer/loop/ordering.py)
and logs what the refill cost.

Tries. A place in a step is tried at most `dynamic_sampling_max_tries` times: a dropped group's replacement inherits
its try count + 1, and the group of the last try is kept whatever its rewards (marked `meta["capped"]`, trained with
zero advantage, as without dynamic sampling). A run on a task the model has solved thus generates at most
max_tries x groups_per_step groups per step and never stalls; the step records say how often it happened.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inflight.contracts import Group, Sample

KEEP, DROP, CAPPED = "keep", "drop", "capped"


def informative(rewards: list[float]) -> bool:
    """A group with a learning signal: its rewards are not all equal (DAPO: 0 < #correct < G)."""
    return len(set(rewards)) > 1


def model_tokens(group: Group) -> int:
    """Completion tokens the model generated for a group (an environment's tokens excluded)."""
    return sum(len(s.completion_ids) if s.loss_mask is None else sum(s.loss_mask) for s in group)


@dataclass
class Refill:
    """Which groups are dropped, and the try count of each place (see the module docstring)."""

    max_tries: int = 10  # 0 = no limit
    dropped: int = 0
    capped: int = 0
    dropped_tokens: int = 0
    _retries: list[int] = field(default_factory=list)  # try numbers owed to places given back, oldest first

    def next_try(self) -> int:
        """The try number of a group starting now: a place given back first, else a new place's first try."""
        return self._retries.pop(0) if self._retries else 1

    def judge(self, group: Group, tries: int) -> str:
        """KEEP, DROP (its place is tried again) or CAPPED (all equal, kept: the place's last try); marks the
        group's samples."""
        if informative([s.reward for s in group]):
            return KEEP
        if self.max_tries and tries >= self.max_tries:
            self.capped += 1
            for s in group:
                s.meta["capped"] = True
            return CAPPED
        self.dropped += 1
        self.dropped_tokens += model_tokens(group)
        self._retries.append(tries + 1)
        for s in group:
            s.meta["dropped"] = True
        return DROP

    def failed(self, tries: int) -> None:
        """A group that failed gives its place back with the tries it had (a failure is not a try)."""
        if tries > 1:
            self._retries.append(tries)


def is_dropped(group: Group) -> bool:
    return bool(group) and bool(group[0].meta.get("dropped"))


def refill_stats(passed: list[tuple[int, int]], samples: list[Sample], groups_per_step: int) -> dict[str, Any]:
    """A step record's dynamic-sampling figures: the dropped groups passed over while the step was collected
    ((index, model tokens) each) and the step's trained samples (those of capped groups marked)."""
    dropped = len(passed)
    capped = {s.meta.get("group_index") for s in samples if s.meta.get("capped")}
    trained_tokens = sum(len(s.completion_ids) if s.loss_mask is None else sum(s.loss_mask) for s in samples)
    return {
        "groups_dropped": dropped,
        "groups_generated": groups_per_step + dropped,  # what the step cost the servers, in groups
        "dropped_frac": dropped / (groups_per_step + dropped),
        "tokens_dropped": sum(t for _, t in passed),
        "tokens_dropped_frac": sum(t for _, t in passed) / max(1, sum(t for _, t in passed) + trained_tokens),
        "groups_capped": len(capped),  # rewards all equal on a place's last try: trained with zero advantage
        "dropped_group_indices": [k for k, _ in passed],
    }
