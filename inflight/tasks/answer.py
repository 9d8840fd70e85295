"""Answer extraction shared by the tasks: the content of the last `\\boxed{...}` (braces may nest)."""

from __future__ import annotations

from inflight.contracts import Verdict, Verification

BOX = "\\boxed{"


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
