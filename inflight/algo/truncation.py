"""What training does with a completion the length limit cut off (`finish_reason` "length"): `algo.truncated`.

    mask          left out of the loss: none of its tokens trains (DAPO's overlong filtering; TRL's
                  mask_truncated_completions). Its reward still counts in its group's baseline, as there.
    zero_reward   scored as a failure: reward = reward_table["truncated"] (0 unless set), label `truncated`,
                  whatever its text earned; it trains with that reward like any sample.
    soft_penalty  DAPO's soft overlong punishment, on every completion (finished or not):
                      reward -= overlong_penalty * clip((n - (max_tokens - B)) / B, 0, 1)
                  B = overlong_buffer * max_tokens
                  0 up to max_tokens - B tokens, rising linearly to overlong_penalty at the limit. Label unchanged.
    keep          no special handling: the verifier's reward, trained like any sample (the behaviour before the
                  option existed; for comparison).

The reward modes act in the reward service (inflight/rewards/service.py), the mask in the trainer loop. The built-in
verifiers only credit an answer that ends the reply (inflight/tasks/answer.py), so a reply cut off in junk earns 0
in every mode; the modes differ in whether the cut-off reply trains and what a cut-off correct box earns.
Held-out accuracy counts finished replies only, whatever the mode (inflight/actor/evaluate.py).

Default `zero_reward`: measured on the demo (docs/benchmarks.md, "Completions cut off"), it kept completions ending
to the last step with the strict verifier and with a lenient one, needs no parameter, and touches only cut-off
completions; `mask` let the policy escape into the limit (100% cut off) when the verifier was lenient.
"""

from __future__ import annotations

from typing import Any

MODES = ("mask", "zero_reward", "soft_penalty", "keep")
LENGTH = "length"  # the finish_reason of a completion cut off by max_tokens


def check(mode: str, overlong_penalty: float = 1.0, overlong_buffer: float = 0.2) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown algo.truncated {mode!r}; choose one of {list(MODES)}")
    if overlong_penalty < 0 or not 0 < overlong_buffer <= 1:
        raise ValueError(f"need algo.overlong_penalty >= 0 and 0 < algo.overlong_buffer <= 1 "
                         f"(got {overlong_penalty}, {overlong_buffer})")


def is_truncated(finish_reason: str) -> bool:
    return finish_reason == LENGTH


def overlong_penalty(num_tokens: int, max_tokens: int, penalty: float, buffer: float) -> float:
    """DAPO's soft punishment: 0 up to max_tokens - B tokens, then linear up to `penalty` at max_tokens (and
    beyond), B = buffer * max_tokens. 0 when the limit is unknown (max_tokens <= 0)."""
    if penalty == 0 or max_tokens <= 0:
        return 0.0
    b = buffer * max_tokens
    return penalty * min(1.0, max(0.0, (num_tokens - (max_tokens - b)) / b))


def trains(sample: Any, mode: str) -> bool:
    """Whether a sample (contracts.Sample) takes part in the loss: all but truncated ones under `mask`."""
    return not (mode == "mask" and is_truncated(sample.finish_reason))
