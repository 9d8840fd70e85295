"""The chat template a server renders with, and what it can render.

`--chat-template` / `server.chat_template` replaces the model's own template with a file, or with one shipped here
by its short name (`chatml_tools`: ChatML with a Hermes tools section, for ChatML models whose template renders no
tools, such as SmolLM2). `TemplateAbilities` finds out, by rendering a probe conversation, whether a template renders
the request's `tools` (with a tool: a different prompt that names it) and an assistant message's `tool_calls`, and
which tool-call parser fits it (`auto`: hermes when the template writes `<tool_call>`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.engine.api.tool_parser import OPEN, PARSERS

TEMPLATES = Path(__file__).resolve().parent / "templates"
_PROBE_NAME = "inflight_probe_fn_5c1e"
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
_PROBE_CALL = {"id": "call_probe", "type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}


class ChatTemplateError(ValueError):
    pass


def shipped_templates() -> list[str]:
    return sorted(p.stem for p in TEMPLATES.glob("*.jinja"))


def read_chat_template(spec: str) -> str:
    """The template text of `spec`: a shipped template's short name or a file's path."""
    if (TEMPLATES / f"{spec}.jinja").is_file() and not Path(spec).exists():
        return (TEMPLATES / f"{spec}.jinja").read_text()
    path = Path(spec)
    if not path.is_file():
        raise ChatTemplateError(f"chat template {spec!r}: no such file, nor a shipped template "
                                f"({', '.join(shipped_templates())})")
    return path.read_text()


def use_chat_template(tokenizer: Any, spec: str | None) -> None:
    """Replace `tokenizer`'s chat template with `spec`'s (no-op for None / empty)."""
    if spec:
        tokenizer.chat_template = read_chat_template(spec)


def _text(tokenizer: Any, messages: list[dict[str, Any]], **kw: Any) -> str:
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw))


@dataclass
class TemplateAbilities:
    renders_tools: bool  # the `tools` argument changes the prompt (and names the tool)
    renders_tool_calls: bool  # an assistant message's tool_calls appear in the prompt
    parser: str  # the tool-call parser replies are read with: "none" or a name in tool_parser.PARSERS

    @classmethod
    def of(cls, tokenizer: Any, parser: str = "auto") -> "TemplateAbilities":
        if parser not in ("auto", "none", *PARSERS):
            raise ChatTemplateError(f"tool-call parser {parser!r}: choose auto, none or {', '.join(PARSERS)}")
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            return cls(False, False, "none" if parser == "auto" else parser)
        user = [{"role": "user", "content": "hi"}]
        try:
            plain = _text(tokenizer, user)
            with_tools = _text(tokenizer, user, tools=[_PROBE_TOOL])
            tools = with_tools != plain and _PROBE_NAME in with_tools
        except Exception:  # noqa: BLE001 - a template that fails on tools has no tools section
            tools = False
        try:
            called = _text(tokenizer, [*user, {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}])
            calls = _PROBE_NAME in called
        except Exception:  # noqa: BLE001 - likewise for tool_calls
            calls = False
        if parser == "auto":
            parser = "hermes" if tools and OPEN in str(template) else "none"
        return cls(tools, calls, parser)

    def call_opening(self, name: str | None) -> str:
        """The text a reply starts with when tool_choice forces a call (`name`: of that function)."""
        if self.parser != "hermes":
            raise ChatTemplateError("forcing a tool call needs a tool-call parser")
        if name is None:
            return OPEN + "\n"
        return OPEN + '\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
