"""Structured outputs on the OpenAI routes, under the names vLLM's server uses: what a request asks its output to
match, as the engine's GrammarSpec (model/grammar.py compiles and enforces it).

- `response_format`: {"type": "text"} (no constraint), {"type": "json_object"} (any JSON object), {"type":
  "json_schema", "json_schema": {"name", "schema", "strict"}} (JSON valid against the schema; enforced whatever
  `strict` says, as vLLM does), {"type": "structural_tag", "format": {...}} (xgrammar's structural tag).
- `structured_outputs`: {"json": schema, "regex", "choice": [..], "grammar": EBNF or Lark, "json_object": true,
  "structural_tag"}, exactly one of them; and the older top-level `guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar` (vLLM dropped them in 0.12; clients still send them).
- `tool_choice` "required" or a named function (chat): the reply is a Hermes tool call (tool_parser.py) whose
  arguments match the function's `parameters` schema (`tool_call_spec`).
One constraint per request: two of these at once is a 400. JSON is written compactly (json.dumps' ", " and ": "
separators, no free whitespace): a small model let loose on free whitespace may fill max_tokens with it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from inflight.engine.model.grammar import GrammarSpec


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")  # a structural tag's `format` (any shape: xgrammar checks it)
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _parts(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        if self.type == "structural_tag" and not isinstance((self.model_extra or {}).get("format"), dict):
            raise ValueError("response_format of type structural_tag needs a `format` object")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (StructuredOutputsParams): exactly one constraint."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _one(self):
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported (JSON is written compactly)")
        given = [k for k in ("json_", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            names = [g.rstrip("_") for g in given]
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object, "
                             f"structural_tag (got {names or 'none'})")
        return self

    def spec(self) -> GrammarSpec:
        if self.json_ is not None:
            return json_spec(self.json_)
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.choice is not None:
            return GrammarSpec("choice", json.dumps(self.choice, ensure_ascii=False))
        if self.grammar is not None:
            return GrammarSpec("grammar", self.grammar)
        if self.structural_tag is not None:
            return GrammarSpec("structural_tag", self.structural_tag)
        return GrammarSpec("json_object")


def json_spec(schema: dict[str, Any] | bool | str) -> GrammarSpec:
    """A JSON schema (an object, a boolean, or JSON text of one) as a spec keyed by its canonical text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"invalid JSON schema: not JSON ({e})") from e
    return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True, ensure_ascii=False))


class StructuredFields(BaseModel):
    """The request fields that constrain the output (chat and text completions)."""

    model_config = ConfigDict(extra="ignore")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(default=None, description="extension, as vLLM's")
    guided_json: dict[str, Any] | bool | str | None = Field(default=None, description="extension, vLLM < 0.12")
    guided_regex: str | None = Field(default=None, description="extension, vLLM < 0.12")
    guided_choice: list[str] | None = Field(default=None, description="extension, vLLM < 0.12")
    guided_grammar: str | None = Field(default=None, description="extension, vLLM < 0.12")

    @model_validator(mode="after")
    def _one_constraint(self):
        self.structured_spec()  # raises for two constraints at once, and for a schema that is not JSON
        return self

    def structured_spec(self) -> GrammarSpec | None:
        """The constraint this request asks for (None: none); ValueError when it asks for more than one."""
        found: list[tuple[str, GrammarSpec]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", GrammarSpec("json_object")))
        elif rf is not None and rf.type == "json_schema":
            assert rf.json_schema is not None and rf.json_schema.schema_ is not None  # checked by ResponseFormat
            found.append(("response_format", json_spec(rf.json_schema.schema_)))
        elif rf is not None and rf.type == "structural_tag":
            tag = {"type": "structural_tag", "format": (rf.model_extra or {})["format"]}
            found.append(("response_format", GrammarSpec("structural_tag", json.dumps(tag, sort_keys=True))))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.spec()))
        if self.guided_json is not None:
            found.append(("guided_json", json_spec(self.guided_json)))
        if self.guided_regex is not None:
            found.append(("guided_regex", GrammarSpec("regex", self.guided_regex)))
        if self.guided_choice is not None:
            found.append(("guided_choice", GrammarSpec("choice", json.dumps(self.guided_choice, ensure_ascii=False))))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", GrammarSpec("grammar", self.guided_grammar)))
        if len(found) > 1:
            raise ValueError(f"one structured output constraint per request, got {[n for n, _ in found]}")
        return found[0][1] if found else None

    @property
    def structured_param(self) -> str:
        """The request field that holds the constraint (for an error's `param`)."""
        for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar"):
            if getattr(self, name) is not None:
                return name
        return "tool_choice"


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def tool_call_spec(functions: list[dict[str, Any]], forced: str | None, parallel: bool) -> GrammarSpec:
    """The rest of a reply that must be a Hermes tool call, after the opening the server already wrote at the end
    of the prompt (chat_template.TemplateAbilities.call_opening): with `forced` (a named function), its arguments
    then `}` and the closing tag; else (tool_choice required) `{"name": ..., "arguments": ...}` of one of
    `functions` (their template form: name, parameters) and the closing tag, then, with `parallel`, any number of
    further calls, each on its own lines."""
    schemas = {f["name"]: f["parameters"] for f in functions}
    close = _const("}\n</tool_call>")
    if forced is not None:
        fmt: dict[str, Any] = {"type": "sequence", "elements": [
            {"type": "json_schema", "json_schema": schemas[forced]}, close]}
    else:
        calls = {"type": "or", "elements": [
            {"type": "sequence", "elements": [
                _const('{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '),
                {"type": "json_schema", "json_schema": schema}, close]}
            for name, schema in schemas.items()]}
        fmt = calls
        if parallel:
            more = {"type": "sequence", "elements": [_const("\n<tool_call>\n"), calls]}
            fmt = {"type": "sequence", "elements": [calls, {"type": "star", "content": more}]}
    tag = {"type": "structural_tag", "format": fmt}
    return GrammarSpec("structural_tag", json.dumps(tag, sort_keys=True, ensure_ascii=False))
