"""Answer extraction shared by the tasks, and the rule every built-in verifier applies: only a finished answer counts.

A reply's answer is its one `\\boxed{...}` (braces may nest) when the box is the last thing in the reply: after it
only whitespace, or, with `MATH_TRAILER` (math_jsonl, reasoning_gym), closing math delimiters and a full stop as a
chat model writes them ("... is $\\boxed{42}$."). A reply with junk after its box (`\\boxed{89}\\boxed}\\14`), with two
boxes (a hedge), or with an unclosed box has no final answer: `no_answer`, or `truncated` when the length limit cut
it off. Whether a reply cut off by the limit may still earn its answer's reward is the algorithm's choice
(`algo.truncated`, inflight/algo/truncation.py), not the verifier's; held-out accuracy counts finished replies only.

`task.answer_format: last_number` (arith, for pretrained chat models asked for "the number only") reads the last
number of a finished reply instead; a reply cut off by the limit has none (its final digits may be missing).
"""

from __future__ import annotations

import re

from inflight.contracts import Verdict, Verification

BOX = "\\boxed{"
WHITESPACE = re.compile(r"\s*")
MATH_TRAILER = re.compile(r"(?:\s|\$|\\\]|\\\)|\.|\*)*")  # whitespace, $ \] \) . and markdown's **
ANSWER_FORMATS = ("boxed", "last_number")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")  # 1,234 and 3.5 are one number each


def box_end(text: str, start: int) -> int | None:
    """Index just past the `}` that closes the box opening at `start`, or None when it never closes."""
    depth, i = 1, start + len(BOX)
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def final_boxed(text: str, trailer: re.Pattern[str] = WHITESPACE) -> str | None:
    """Content of the reply's one box when nothing but `trailer` follows it; None otherwise (no box, two boxes,
    an unclosed box, or anything else after it)."""
    start = text.find(BOX)
    if start == -1 or text.find(BOX, start + 1) != -1:
        return None
    end = box_end(text, start)
    if end is None or trailer.fullmatch(text, end) is None:
        return None
    return text[start + len(BOX) : end - 1]


def unanswered(finish_reason: str) -> Verification:
    """No final answer: cut off by the length limit is `truncated`, otherwise `no_answer`."""
    label = Verdict.truncated if finish_reason == "length" else Verdict.no_answer
    return Verification(reward=0.0, label=label)


def graded(ok: bool) -> Verification:
    return Verification(reward=1.0 if ok else 0.0, label=Verdict.correct if ok else Verdict.wrong)


def last_number(text: str) -> str | None:
    """The last number in `text` ("2 + 7 = 9." -> "9"; "-5"; "1,234" -> "1234"), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def check_answer_format(answer_format: str) -> None:
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"task.answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")


def extract_answer(text: str, answer_format: str, finish_reason: str = "stop") -> str | None:
    """The reply's final answer by `answer_format` (`final_boxed` for boxed), None when it has none."""
    if answer_format == "last_number":
        return None if finish_reason == "length" else last_number(text)
    return final_boxed(text)
