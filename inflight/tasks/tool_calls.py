"""Tool calls as text: how a model that is served without an API-level `tools` field sees its tools and calls them.

inflight's server renders prompts with the model's chat template and returns text and tokens; it has no tool
parser (it refuses `tools`). An environment with tools (a verifiers `ToolEnv`) therefore gets them described in a
system message, and the model calls one by writing

    <tool_call>
    {"name": "calc", "arguments": {"expr": "12*34"}}
    </tool_call>

(the Hermes convention that Qwen2.5, Hermes and many instruct models are trained on). `parse_tool_calls` reads
every such block of a reply, also one left open at the end (a reply cut off or stopped at `</tool_call>`). A block
whose JSON does not parse still counts as a call, named "invalid" with the raw text as its arguments, so the
environment answers it with its own error message, as it would for a malformed call from an API.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """The system text that lists `tools` ({name, description, parameters}, one compact JSON line each) and how
    to call them."""
    lines = ['To call a tool, write <tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call> and '
             "wait for its result. Tools:"]
    for t in tools:
        lines.append(json.dumps({"name": t["name"], "description": t.get("description", ""),
                                 "parameters": t.get("parameters", {})}, separators=(",", ":")))
    return "\n".join(lines)


def parse_tool_calls(text: str) -> list[tuple[str, str]]:
    """(name, arguments as a JSON string) of each tool call block in `text`, in order."""
    calls = []
    for raw in _BLOCK.findall(text):
        body = raw.strip()
        try:
            obj = json.loads(body)
        except ValueError:
            calls.append(("invalid", body))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(("invalid", body))
            continue
        args = obj.get("arguments", {})
        calls.append((obj["name"], args if isinstance(args, str) else json.dumps(args)))
    return calls
