"""Answer extraction shared by the tasks: the content of the last `\\boxed{...}` (braces may nest), or the last
number of the reply (`task.answer_format: last_number`)."""

from __future__ import annotations

import re

from inflight.contracts import Verdict, Verification

BOX = "\\boxed{"
ANSWER_FORMATS = ("boxed", "last_number")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")  # 1,234 and 3.5 are one number each


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` in `text`, or None when there is none (or it never closes)."""
    start = text.rfind(BOX)
    while start != -1:
        depth, i = 1, start + len(BOX)
        while i < len(text):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len(BOX) : i]
            i += 1
        start = text.rfind(BOX, 0, start)  # unclosed: an earlier, complete box may still count
    return None


def unanswered(finish_reason: str) -> Verification:
    """No answer found: cut off by the length limit is `truncated`, otherwise `no_answer`."""
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
    """The answer text by `answer_format`, None when there is none. A reply cut by the length limit has no last
    number: its final digits may be missing."""
    if answer_format == "last_number":
        return None if finish_reason == "length" else last_number(text)
    return last_boxed(text)
