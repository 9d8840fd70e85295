"""Tool calls out of a model's reply text (the server's `tool_call_parser`), whole or while it streams.

Hermes convention (Hermes, Qwen2.5, inflight's chatml_tools template): each call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`. A reply parses into
(content, calls): `content` is the text outside the calls (before them; non-blank text between or after them follows
on new lines), None when there is none. The reply stays plain text (content = the whole text, no calls) when any block
is malformed: JSON that does not parse, not an object, a name that is not one of the request's tools, arguments that
are not an object. A last block left open counts only when the model ended its turn (finish_reason "stop").

`HermesStream` gives the same result piece by piece: text before the first `<tool_call>` streams as it comes (less
what may be the start of the tag, or blank text that may end up before a call); from the tag on it holds everything
back until the reply ends, then sends the calls, or the held text as content when the reply is not a valid call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|$)", re.S)
PARSERS = ("hermes",)  # names server.tool_call_parser accepts besides auto / none


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object as a string (OpenAI's `function.arguments`)


@dataclass
class Parsed:
    content: str | None
    calls: list[ToolCall]


def _call(body: str, names: set[str]) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string, as the API does
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str, names: set[str], finished: bool) -> Parsed:
    """(content, calls) of a whole reply; `names`: the request's tool names; `finished`: the model ended its turn
    (an open last block may then be a call)."""
    if OPEN not in text:
        return Parsed(text, [])
    calls, outside, pos = [], [], 0
    for m in _BLOCK.finditer(text):
        if not m.group(2) and not finished:
            return Parsed(text, [])  # cut off inside a call
        call = _call(m.group(1).strip(), names)
        if call is None:
            return Parsed(text, [])
        calls.append(call)
        outside.append(text[pos:m.start()])
        pos = m.end()
    outside.append(text[pos:])
    head = outside[0].rstrip()
    pieces = ([head] if head.strip() else []) + [s.strip() for s in outside[1:] if s.strip()]
    return Parsed("\n".join(pieces) or None, calls)


def _held_prefix(text: str) -> int:
    """How many characters at the end of `text` may be the start of OPEN."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


class HermesStream:
    """One choice's stream: `feed(delta) -> content to send now`; `finish(finished) -> Parsed` for the rest (its
    content is what is left to send; the calls, if any)."""

    def __init__(self, names: set[str]):
        self.names = names
        self.text = ""  # the whole reply so far
        self.sent = 0  # characters of `text` sent as content
        self.in_call = False  # an OPEN tag has been seen

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.in_call:
            return ""
        at = self.text.find(OPEN, self.sent)
        if at >= 0:
            self.in_call = True
            safe = len(self.text[:at].rstrip())
        else:
            held = _held_prefix(self.text)
            body = self.text[:len(self.text) - held]
            safe = len(body.rstrip())  # blank text may turn out to stand before a call
        out = self.text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out

    def finish(self, finished: bool) -> Parsed:
        whole = parse_hermes(self.text, self.names, finished)
        if not whole.calls:
            return Parsed(self.text[self.sent:] or None, [])
        rest = (whole.content or "")[self.sent:]  # the content's head was sent as the text's head
        return Parsed(rest or None, whole.calls)


def call_dict(call: ToolCall, call_id: str, index: int | None = None) -> dict[str, Any]:
    """A call as OpenAI's `tool_calls` entry (`index` for a stream's delta)."""
    out: dict[str, Any] = {} if index is None else {"index": index}
    out.update(id=call_id, type="function", function={"name": call.name, "arguments": call.arguments})
    return out
