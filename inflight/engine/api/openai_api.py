"""Request schemas of the OpenAI-compatible API (+ inflight's extensions) and builders of the response bodies.

Requests are pydantic models: unknown fields are ignored (OpenAI clients send many), but every field we read is
validated, and fields we cannot honour (penalties, logit_bias, echo in chat) are rejected when set to a non-default
value, so a client never silently gets something other than what it asked for. Tools (`tools`, `tool_choice`,
`parallel_tool_calls`, assistant `tool_calls`, `tool` messages) are checked here; what the chat template makes of
them is the route's (routes_openai.py, chat_template.py, tool_parser.py).
Structured outputs (`response_format`, vLLM's `structured_outputs` and `guided_*`) are read by structured.py.
Prompt logprobs (`echo` + `logprobs`, vLLM's `prompt_logprobs`) come from the engine's PromptScores
(prompt_scores.py); `prompt_fields` lays them out in the response.
Responses are plain dicts (1,000 concurrent requests: no need for a second validation pass on the way out).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from inflight.engine.api.structured import StructuredFields

MAX_TOP_LOGPROBS = 20


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CalledFunction(_Lenient):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's shape)

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            obj = json.loads(v)
        except ValueError as e:
            raise ValueError(f"function.arguments is not valid JSON ({e})") from e
        if not isinstance(obj, dict):
            raise ValueError("function.arguments must be a JSON object")
        return v


class MessageToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages: the calls it made
    tool_call_id: str | None = None  # tool messages: the call this is the result of
    name: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls are for assistant messages, not {self.role!r}")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (HF convention: a call's arguments as a mapping)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:  # OpenAI "content parts": only text is supported
            if part.get("type") != "text":
                raise ValueError(f"unsupported content part type {part.get('type')!r} (only 'text')")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class FunctionDef(_Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None

    def for_template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            out["description"] = self.description
        out["parameters"] = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        return out


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Sampling(StructuredFields):
    """Fields shared by chat and text completions (the structured-output ones in structured.py)."""

    model: str
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # bounded: the engine packs sampling values into int64 / float32 tensors for the whole batch
    top_k: int = Field(default=0, ge=-1, le=2**31 - 1, description="extension; 0 or -1 = off")
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list, description="extension")
    ignore_eos: bool = Field(default=False, description="extension")
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1,
                          description="extension, as vLLM's: a waiting request with a lower value starts first")
    min_weight_version: int | None = Field(default=None, ge=0, le=2**62, description=(
        "extension: the request waits until the server holds at least this weight version, so that no token of it "
        "comes from older weights (the actor's staleness bound then needs no round trip after a push); 409 if it "
        "has not come within the server's --version-wait-s"))
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "extension, as vLLM's: the logprob, rank and top alternatives of every prompt token (temperature 1)"))

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else list(v)
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return stops

    @model_validator(mode="after")
    def _unsupported(self):
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty / frequency_penalty are not supported (must be 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported with stream=true (send a non-streaming request)")
        return self

    @property
    def prompt_score_k(self) -> int | None:
        """Alternatives per prompt position the engine must compute, or None when the prompt is not scored."""
        return self.prompt_logprobs

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])  # a list once validated; None when the field was left out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = Field(default=True, description="extension")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    echo: bool = False

    @model_validator(mode="after")
    def _chat_checks(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: function names must be unique, got {names}")
        if not names and self.tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools (the request has none)")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not "
                             f"one of the request's tools {names}")
        if self.echo:
            raise ValueError("echo is not supported by chat completions: send the prompt to /v1/completions with "
                             "echo=true, or ask for prompt_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def tool_names(self) -> set[str]:
        return {t.function.name for t in self.tools or []}

    @property
    def choice(self) -> str:
        """tool_choice as one word: none, auto, required or named (the default: auto with tools, else none)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def forced_function(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def num_top_logprobs(self) -> int:
        return self.top_logprobs if self.logprobs else 0


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0, description="0: score the prompt only (echo / prompt_logprobs)")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion_checks(self):
        if self.echo and self.stream:
            raise ValueError("echo is not supported with stream=true (send a non-streaming request)")
        if self.max_tokens == 0 and not (self.echo or self.prompt_logprobs is not None):
            raise ValueError("max_tokens=0 generates nothing: it is only for scoring the prompt (echo=true with "
                             "logprobs, or prompt_logprobs)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1) and self.best_of != self.n:
            raise ValueError("best_of is not supported")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt is empty")
        if isinstance(self.prompt, list) and len(self.prompt) > 1 and not isinstance(self.prompt[0], int):
            raise ValueError("only one prompt per request (send one request per prompt)")
        return self

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return p[0]  # a list holding one prompt (text or ids)
        return p  # type: ignore[return-value]

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or 0

    @property
    def prompt_score_k(self) -> int | None:
        echoed = self.logprobs if self.echo else None  # echo with logprobs: k alternatives per prompt token too
        wanted = [k for k in (echoed, self.prompt_logprobs) if k is not None]
        if self.echo and self.max_tokens == 0:
            wanted.append(0)  # nothing generated: the engine still prefills the prompt once (its version)
        return max(wanted) if wanted else None


# --------------------------------------------------------------------------------------------------------------
# Response builders. `ch` is a finished choice: see request.Choice (text, token_ids, logprobs, tops, versions, ...).
# --------------------------------------------------------------------------------------------------------------


def _lp_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(tokens: list[str], logprobs: list[float], tops: list[list[tuple[str, float]]] | None) -> dict:
    content = []
    for i, (tok, lp) in enumerate(zip(tokens, logprobs)):
        entry = _lp_entry(tok, lp)
        entry["top_logprobs"] = [_lp_entry(t, v) for t, v in tops[i]] if tops else []
        content.append(entry)
    return {"content": content}


def completion_logprobs(tokens: list[str], logprobs: list[float], tops: list[list[tuple[str, float]]] | None) -> dict:
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": [dict(t) for t in tops] if tops else None,
        "text_offset": offsets,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(kind: Literal["chat", "text"], rid: str, model: str, choices: list[dict], use: dict | None,
             chunk: bool = False) -> dict[str, Any]:
    obj = {"chat": "chat.completion", "text": "text_completion"}[kind] + (".chunk" if chunk and kind == "chat" else "")
    body: dict[str, Any] = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices}
    if use is not None or not chunk:
        body["usage"] = use
    return body


def prompt_fields(body: dict[str, Any], scores: Any, prompt_ids: list[int], echo_text: str | None,
                  req: CompletionRequest | ChatCompletionRequest, tok_str: Callable[[int], str]) -> None:
    """Adds the prompt's part to a finished choice's body: with `echo` (completions) the prompt's text before the
    completion and, with logprobs, one legacy entry per prompt token (the first None) before the generated ones;
    with `prompt_logprobs`, vLLM's per-token dicts; and `prompt_token_versions`, the weight version of the forward
    that scored each prompt token (the first None), as `token_versions` does for generated tokens."""
    if echo_text is not None:
        body["text"] = echo_text + body["text"]
    if scores is None:
        return
    body["prompt_token_versions"] = scores.versions
    if echo_text is not None and body.get("logprobs") is not None:
        k, gen = req.num_top_logprobs, body["logprobs"]
        toks = [tok_str(t) for t in prompt_ids]
        tops = [None] + [{tok_str(t): v for t, v in row[:k]} for row in scores.tops[1:]] if k else None
        lp = completion_logprobs(toks + gen["tokens"], scores.logprobs + gen["token_logprobs"], None)
        if tops is not None:
            lp["top_logprobs"] = tops + (gen["top_logprobs"] or [])
        body["logprobs"] = lp
    if req.prompt_logprobs is not None:
        k = req.prompt_logprobs
        rows: list[dict[str, dict[str, Any]] | None] = [None]  # the first prompt token has no logprob
        for pos in range(1, len(prompt_ids)):
            tid = prompt_ids[pos]
            row = {str(tid): {"logprob": scores.logprobs[pos], "rank": scores.ranks[pos],
                              "decoded_token": tok_str(tid)}}
            for rank, (t, v) in enumerate(scores.tops[pos][:k], start=1):
                row.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": tok_str(t)})
            rows.append(row)
        body["prompt_logprobs"] = rows
