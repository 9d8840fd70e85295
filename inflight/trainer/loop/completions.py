"""Completion lengths and endings per trainer step, and the warning when the length limit keeps cutting them off.

A policy that learns never to stop (the answer, then junk up to max_new_tokens) looks healthy in reward and accuracy
alone; these numbers show it: every step logs the completion length mean / min / max, the share of completions the
limit cut off (`truncated_frac`, finish_reason "length") and the share that ended with the end-of-sequence token
(`eos_frac`, finish_reason "stop"), like TRL's completions/* metrics.
"""

from __future__ import annotations

import logging
from typing import Any

from inflight.algo.truncation import is_truncated

log = logging.getLogger(__name__)


def completion_stats(samples: list[Any]) -> dict[str, float]:
    """Length and ending stats of one step's samples (contracts.Sample); `prompt_tokens` counts each group's
    prompt once (the engine prefills a group's shared prompt once), `completion_tokens` every generated token."""
    lengths = [len(s.completion_ids) for s in samples]
    n = max(1, len(samples))
    ended = [len(s.completion_ids) for s in samples if s.finish_reason == "stop"]
    prompts = {s.group_id: len(s.prompt_ids) for s in samples}
    return {
        "completion_len_mean": sum(lengths) / n,
        "completion_len_min": min(lengths, default=0),
        "completion_len_max": max(lengths, default=0),
        "terminated_len_mean": sum(ended) / len(ended) if ended else 0.0,  # of the completions that ended (EOS)
        "truncated_frac": sum(is_truncated(s.finish_reason) for s in samples) / n,
        "eos_frac": len(ended) / n,
        "completion_tokens": sum(lengths),
        "prompt_tokens": sum(prompts.values()),
    }


class TruncationAlarm:
    """Warns once when the truncated share of the last `steps` steps all stayed above `threshold`, and again after
    every further `steps` steps it stays there (0 steps: never)."""

    def __init__(self, threshold: float = 0.5, steps: int = 20):
        self.threshold, self.steps, self.run = threshold, steps, 0

    def update(self, truncated_frac: float) -> str | None:
        """Feed one step's truncated share; returns the warning text when one is due."""
        self.run = self.run + 1 if truncated_frac > self.threshold else 0
        if not self.steps or not self.run or self.run % self.steps:
            return None
        msg = (f"{100 * truncated_frac:.0f}% of this step's completions hit max_new_tokens, and more than "
               f"{100 * self.threshold:.0f}% for {self.run} steps in a row: the policy may have learnt not to stop "
               f"(see the report's completion lengths and replies; algo.truncated decides how they train)")
        log.warning(msg)
        return msg
