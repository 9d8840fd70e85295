"""The OpenAI-compatible API of an inflight server (docs/inference-contract.md): /v1/chat/completions,
/v1/completions and /v1/models, as a FastAPI router over any engine with the built-in engine's surface (the
built-in `InferenceEngine`, the vLLM backend's `VLLMEngine`)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from inflight.engine.api import openai_api as oa
from inflight.engine.api.chat_template import TemplateAbilities
from inflight.engine.api.guards import Admission
from inflight.engine.api.http_errors import Auth, BadRequest
from inflight.engine.api.metrics import ServerMetrics
from inflight.engine.api.prompts import Prompts
from inflight.engine.api.structured import tool_call_spec
from inflight.engine.model.grammar import GrammarSpec
from inflight.engine.scheduler.request import Choice, Generation
from inflight.engine.model.sampling import SamplingParams
from inflight.engine.api.tool_parser import CLOSE, HermesStream, Parsed, call_dict, parse_hermes

log = logging.getLogger("inflight.engine.api.server")
Kind = Literal["chat", "text"]  # the route: /v1/chat/completions or /v1/completions
OpenAIRequest = oa.ChatCompletionRequest | oa.CompletionRequest


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class FastJSON(JSONResponse):
    """Completions with per-token logprobs are mostly JSON encoding: orjson does it ~5x faster than json."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class Releasing(StreamingResponse):
    """A streaming response that frees its admission slot however the stream ends (even if never started)."""

    def __init__(self, inner: StreamingResponse, release: Any):
        super().__init__(inner.body_iterator, media_type=inner.media_type)
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


class ToolUse:
    """How one chat request's reply is read for tool calls: `parse` (a parser reads it), the request's tool names,
    and the text the server wrote at the start of the reply to force a call (tool_choice required / a function),
    with the grammar the rest of the reply then follows (`grammar`: the call's format and its arguments' schema)."""

    def __init__(self, req: oa.ChatCompletionRequest, abilities: TemplateAbilities):
        self.names = req.tool_names
        self.parse = bool(self.names) and req.choice != "none"
        if self.parse and abilities.parser == "none":
            raise BadRequest(f"tool_choice {req.choice!r} needs a tool-call parser, and this server has none for its "
                             "chat template (serve with --tool-call-parser hermes, or send tool_choice 'none' to get "
                             "the reply as text)", "tool_choice")
        forced = req.choice in ("required", "named")
        self.opening = abilities.call_opening(req.forced_function) if forced else ""
        self.grammar: GrammarSpec | None = None
        if forced:
            functions = [t.function.for_template() for t in req.tools or []]
            self.grammar = tool_call_spec(functions, req.forced_function, req.parallel_tool_calls)
        # one call only: the reply ends with it (the stop string is cut from the text; the parser accepts the
        # block left open by a model that ended there)
        self.stops = [CLOSE] if self.parse and (req.choice == "named" or not req.parallel_tool_calls) else []

    def parsed(self, ch: Choice) -> Parsed:
        return parse_hermes(self.opening + ch.text, self.names, finished=ch.finish_reason == "stop")


def openai_router(engine: Any, admission: Admission, auth: Auth, *, max_n: int | None = None,
                  version_wait_s: float = 300.0, tool_call_parser: str = "auto",
                  metrics: ServerMetrics | None = None) -> APIRouter:
    """The OpenAI routes, every one behind `auth.key`. `admission` holds the queue limit (429); `max_n` caps a
    request's `n` (default: the engine's batch); a `min_weight_version` not reached in `version_wait_s` is a 409.
    `tool_call_parser` reads tool calls out of chat replies (auto: the one the chat template writes; none).
    `metrics`: where the requests' timings go (metrics.py)."""
    api = OpenAIRoutes(engine, admission, max_n=max_n, version_wait_s=version_wait_s,
                       tool_call_parser=tool_call_parser, metrics=metrics)
    router = APIRouter(dependencies=[Depends(auth.key)])

    @router.post("/v1/chat/completions")
    async def chat_completions(req: oa.ChatCompletionRequest, request: Request):
        return await api.complete("chat", request, req)

    @router.post("/v1/completions")
    async def completions(req: oa.CompletionRequest, request: Request):
        return await api.complete("text", request, req)

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return api.models()

    return router


@dataclass
class Reply:
    """What one request's answer is made of: the route (`kind`), the request, its generation, whether it wants
    logprobs, and how its reply is read for tool calls (chat only)."""

    kind: Kind
    req: OpenAIRequest
    gen: Generation
    want_lp: bool
    tools: ToolUse | None

    @property
    def rid(self) -> str:
        return f"{self.kind}-{self.gen.rid}"

    def usage(self) -> dict[str, int]:
        return oa.usage(len(self.gen.prompt_ids), sum(len(c.token_ids) for c in self.gen.choices))

    def sse(self, choices: list[dict], use: dict | None = None) -> bytes:
        """One server-sent event of a stream: a chunk with `choices` (and `use`, the usage)."""
        return b"data: " + orjson.dumps(oa.envelope(self.kind, self.rid, self.req.model, choices, use,
                                                    chunk=True)) + b"\n\n"


class OpenAIRoutes:
    """What the OpenAI routes share: the engine, the admission (queue limit), the request limits, the prompt
    renderer, a cache of token texts for logprobs, and the chat template's abilities (read on first use: the
    engine's tokenizer is final by then). A request goes: `complete` checks it and builds its generation, then
    `run_full` (one JSON answer) or `run_stream` (server-sent events) answers it from `full_choice` /
    `chunk_choice`."""

    def __init__(self, engine: Any, admission: Admission, *, max_n: int | None, version_wait_s: float,
                 tool_call_parser: str, metrics: ServerMetrics | None):
        self.engine, self.admission, self.metrics = engine, admission, metrics
        self.limit_n = max_n or int(getattr(engine, "max_batch", 128))
        self.version_wait_s, self.tool_call_parser = version_wait_s, tool_call_parser
        self.prompts = Prompts(engine)
        self._tok_cache: dict[int, str] = {}
        self._abilities: TemplateAbilities | None = None

    # ---- the routes -------------------------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        engine = self.engine
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "inflight", "max_model_len": engine.max_model_len,
                                            "version": engine.version}]}

    async def complete(self, kind: Kind, request: Request, req: OpenAIRequest) -> Any:
        arrival = time.monotonic()  # the metrics' arrival: before the prompt is rendered and tokenized
        self.check_model(req.model)
        tools = self.chat_tools(req) if isinstance(req, oa.ChatCompletionRequest) else None
        if tools is not None:
            prompt_ids = await self.prompts.chat(req, tools.opening)  # type: ignore[arg-type]
        else:
            prompt_ids = await self.prompts.text(req)  # type: ignore[arg-type]
        params = self.sampling(req, prompt_ids)
        params.structured = await self.structured(req, tools)
        want_lp = req.logprobs is not None and req.logprobs is not False
        release = self.admission.reserve(req.n)  # after validation: a bad request is a 400, never a 429
        handed_over = False  # to the streaming response, which releases when it ends
        try:
            reply = Reply(kind, req, self.generation(req, prompt_ids, params, tools, arrival), want_lp, tools)
            if req.stream:
                # a stream's 409 (version not reached) is raised here, before the response exists
                response = Releasing(await self.run_stream(reply), release)
                handed_over = True
                return response
            return await self.run_full(request, reply)
        finally:
            if not handed_over:  # every other way out: answered, refused, failed, cancelled
                release()

    # ---- checks -----------------------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.engine.model_name:
            raise BadRequest(f"model {name!r} does not exist; this server serves {self.engine.model_name!r}",
                             "model", code="model_not_found")

    def abilities(self) -> TemplateAbilities:
        if self._abilities is None:
            self._abilities = TemplateAbilities.of(self.engine.tokenizer, self.tool_call_parser)
        return self._abilities

    def chat_tools(self, req: oa.ChatCompletionRequest) -> ToolUse:
        """What the request does with tools, once the template is known to render what it holds."""
        can, name = self.abilities(), self.engine.model_name
        if req.tools and not can.renders_tools:
            raise BadRequest(f"the chat template of {name!r} has no tools section (it renders the same prompt with "
                             "and without tools), so the model would never see them: serve it with --chat-template "
                             "chatml_tools (ChatML models) or a template of your own that renders `tools`", "tools")
        if any(m.tool_calls for m in req.messages) and not can.renders_tool_calls:
            raise BadRequest(f"the chat template of {name!r} does not render an assistant message's tool_calls: "
                             "serve it with a template that does (--chat-template)", "messages")
        return ToolUse(req, can)

    def sampling(self, req: OpenAIRequest, prompt_ids: list[int]) -> SamplingParams:
        """The engine's sampling parameters, once the prompt and the request fit the context and the limits."""
        max_new = self.check_lengths(req, prompt_ids)
        if req.n > self.limit_n:
            raise BadRequest(f"n={req.n} is over this server's limit of {self.limit_n}", "n")
        vocab = int(getattr(self.engine, "vocab_size", len(self.engine.tokenizer)))
        bad = [t for t in req.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"stop_token_ids out of vocabulary: {bad[:5]}", "stop_token_ids")
        if req.prompt_score_k is not None and not getattr(self.engine, "scores_prompts", False):
            raise BadRequest("this engine does not compute prompt logprobs (echo, prompt_logprobs)", "echo")
        return SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0), max_tokens=max_new,
            stop_token_ids=list(req.stop_token_ids), seed=req.seed, n=req.n,
            top_logprobs=req.num_top_logprobs, ignore_eos=req.ignore_eos,
            priority=req.priority, prompt_logprobs=req.prompt_score_k,
        )

    async def structured(self, req: OpenAIRequest, tools: ToolUse | None) -> GrammarSpec | None:
        """The constraint the request puts on its output (structured.py), compiled once here (on a worker thread: a
        new JSON schema takes up to ~0.5 s) so that a bad one is a 400 naming the problem."""
        spec, param = req.structured_spec(), req.structured_param
        can = getattr(self.engine, "constrains_outputs", False)
        if tools is not None and tools.grammar is not None:
            if spec is not None:
                raise BadRequest(f"tool_choice constrains the reply to a tool call: it cannot be combined with {param} "
                                 "(one structured output constraint per request)", "tool_choice")
            if not can:  # an engine without grammars (vLLM backend): the forced opening only, as before
                return None
            spec, param = tools.grammar, "tool_choice"
        if spec is None:
            return None
        if not can:
            raise BadRequest(f"this engine does not constrain outputs ({param}): structured outputs need the "
                             "built-in engine", param)
        try:
            await asyncio.to_thread(self.engine.grammars().compile, spec)
        except ValueError as e:
            raise BadRequest(f"{param}: {e}", param) from e
        return spec

    def check_lengths(self, req: OpenAIRequest, prompt_ids: list[int]) -> int:
        """The tokens the request may generate: its max_tokens, or the rest of the context; 400 when the prompt
        is empty or it does not fit."""
        ctx = self.engine.max_model_len
        if len(prompt_ids) == 0:
            raise BadRequest("the prompt is empty", "prompt")
        if len(prompt_ids) >= ctx:
            raise BadRequest(f"prompt has {len(prompt_ids)} tokens; the context is {ctx} tokens (prompt must be "
                             f"shorter to leave room for at least one generated token)", "messages",
                             code="context_length_exceeded")
        max_new = req.max_new_tokens
        if max_new is None:
            return ctx - len(prompt_ids)
        if len(prompt_ids) + max_new > ctx:
            raise BadRequest(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_new}) exceeds the context of "
                             f"{ctx} tokens", "max_tokens", code="context_length_exceeded")
        return max_new

    def generation(self, req: OpenAIRequest, prompt_ids: list[int], params: SamplingParams, tools: ToolUse | None,
                   arrival: float) -> Generation:
        """The request's generation, with its stop strings and the tool parser's. A request for weights not here
        yet is held by the engine (a version that never comes must not hold a connection and a queue place
        forever: 409 after version_wait_s)."""
        min_version = req.min_weight_version or 0
        stops = req.stops + [s for s in (tools.stops if tools else []) if s not in req.stops]
        return Generation(self.engine, prompt_ids, params, stops, req.n, want_text=req.stream,
                          min_version=min_version if min_version > self.engine.version else 0,
                          version_wait_s=self.version_wait_s, arrival=arrival, metrics=self.metrics)

    # ---- answers ----------------------------------------------------------------------------------------------
    async def run_full(self, request: Request, reply: Reply) -> JSONResponse:
        """Non-streaming: generate every choice; cancel when the client goes away."""
        if not await run_unless_disconnected(request, reply.gen):
            log.info("client disconnected; request %s aborted", reply.gen.rid)
            return JSONResponse({}, 499)
        gen, req = reply.gen, reply.req
        body = [self.full_choice(reply, ch) for ch in gen.choices]
        echo = getattr(req, "echo", False) and reply.kind == "text"
        if echo or gen.prompt_scores is not None:
            text = req.single_prompt() if echo else None  # type: ignore[union-attr]
            text = self.engine.tokenizer.decode(text) if isinstance(text, list) else text
            for b in body:
                oa.prompt_fields(b, gen.prompt_scores, gen.prompt_ids, text, req, self.tok_str)
        return FastJSON(oa.envelope(reply.kind, reply.rid, req.model, body, reply.usage()))

    async def run_stream(self, reply: Reply) -> StreamingResponse:
        """A request held for its weights waits here for its first event: a version that never comes is a 409, not
        a stream that breaks off after its headers. A reply read for tool calls streams its text up to a call; the
        calls come in the choice's last chunk (tool_parser.HermesStream)."""
        events = reply.gen.events()
        first = [await anext(events)] if reply.gen.gate else []
        return StreamingResponse(self.stream_body(reply, first, events), media_type="text/event-stream")

    async def stream_body(self, reply: Reply, first: list[Choice], events: AsyncIterator[Choice]) \
            -> AsyncIterator[bytes]:
        gen, tools = reply.gen, reply.tools
        readers = None
        if tools is not None and tools.parse:
            readers = [HermesStream(tools.names) for _ in gen.choices]
            for r in readers:
                r.feed(tools.opening)
        if reply.kind == "chat":  # OpenAI's first chunk announces the role
            yield reply.sse([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for c in gen.choices])
        done_tokens = [0] * len(gen.choices)
        async for ch in _chain(first, events):
            new = slice(done_tokens[ch.index], len(ch.token_ids))
            delta, calls = stream_text(gen, ch, readers)
            if new.start == new.stop and not delta and ch.finish_reason is None:
                continue
            done_tokens[ch.index] = new.stop
            yield reply.sse([self.chunk_choice(reply, ch, delta, new, calls)])
        stream_options = reply.req.stream_options
        if stream_options and stream_options.include_usage:
            yield reply.sse([], reply.usage())
        yield b"data: [DONE]\n\n"

    # ---- choices ----------------------------------------------------------------------------------------------
    def full_choice(self, reply: Reply, ch: Choice) -> dict[str, Any]:
        """One choice of a whole reply; a chat reply read for tool calls gets the calls found in it."""
        sl = slice(0, len(ch.token_ids))
        ids, lp = self.tokens(reply, ch, sl)
        body: dict[str, Any] = {"index": ch.index}
        finish = ch.finish_reason
        if reply.kind == "chat":
            body["message"] = {"role": "assistant", "content": ch.text}
            if reply.tools is not None and reply.tools.parse:
                got = reply.tools.parsed(ch)
                body["message"]["content"] = got.content
                if got.calls:
                    body["message"]["tool_calls"] = [call_dict(c, new_call_id()) for c in got.calls]
                    finish = "tool_calls"
        else:
            body["text"] = ch.text
        body.update(logprobs=lp, finish_reason=finish, token_ids=ids, token_versions=ch.versions[sl])
        if reply.gen.params.structured is not None:
            body["token_constrained"] = ch.constrained[sl]
            if reply.want_lp:
                body["token_raw_logprobs"] = ch.raw_logprobs[sl]
        body["prompt_token_ids"] = reply.gen.prompt_ids
        return body

    def chunk_choice(self, reply: Reply, ch: Choice, delta: str, new: slice, calls: Parsed | None) \
            -> dict[str, Any]:
        """One choice of a stream chunk: its tokens `new` and text `delta` since the last chunk (`calls`: the tool
        calls found when the choice ended)."""
        ids, lp = self.tokens(reply, ch, new)
        body: dict[str, Any] = {"index": ch.index}
        finish = ch.finish_reason
        if reply.kind == "chat":
            body["delta"] = {"content": delta} if delta or ids else {}
            if calls is not None and calls.calls:
                body["delta"]["tool_calls"] = [call_dict(c, new_call_id(), i) for i, c in enumerate(calls.calls)]
                finish = "tool_calls"
        else:
            body["text"] = delta
        body.update(logprobs=lp, finish_reason=finish, token_ids=ids, token_versions=ch.versions[new])
        if reply.gen.params.structured is not None:
            body["token_constrained"] = ch.constrained[new]
            if reply.want_lp:
                body["token_raw_logprobs"] = ch.raw_logprobs[new]
        if new.start == 0:
            body["prompt_token_ids"] = reply.gen.prompt_ids
        return body

    def tokens(self, reply: Reply, ch: Choice, sl: slice) -> tuple[list[int], dict | None]:
        """The choice's token ids in `sl`, and their logprobs in the route's layout when the request wants them."""
        ids = ch.token_ids[sl]
        if not reply.want_lp:
            return ids, None
        top_n = reply.req.num_top_logprobs
        toks = [self.tok_str(t) for t in ids]
        tops = [[(self.tok_str(t), v) for t, v in row[:top_n]] for row in ch.tops[sl]] if top_n else None
        layout = oa.chat_logprobs if reply.kind == "chat" else oa.completion_logprobs
        return ids, layout(toks, ch.logprobs[sl], tops)

    def tok_str(self, tid: int) -> str:
        s = self._tok_cache.get(tid)
        if s is None:
            s = self._tok_cache[tid] = self.engine.tokenizer.decode([tid])
        return s


async def run_unless_disconnected(request: Request, gen: Generation) -> bool:
    """Runs the generation to its end, or until the client goes away (False: then it is cancelled, which aborts
    it in the engine)."""

    async def consume() -> None:
        async for _ in gen.events():
            pass

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    work, watch = asyncio.ensure_future(consume()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():  # client left: cancelling runs the generator's finally (engine.abort)
            work.cancel()
            await asyncio.wait({work})  # until the cancel has run: work.cancelled() is true only then
    if work.cancelled():
        return False
    work.result()
    return True


async def _chain(first: list[Choice], events: AsyncIterator[Choice]) -> AsyncIterator[Choice]:
    """The events a stream already took (`first`), then the rest."""
    for ch in first:
        yield ch
    async for ch in events:
        yield ch


def stream_text(gen: Generation, ch: Choice, readers: list[HermesStream] | None) -> tuple[str, Parsed | None]:
    """The text of `ch` that is safe to stream now. A reply read for tool calls (`readers`, one per choice) holds a
    call's text back; when the choice ends, its reader gives the calls found (and any text left)."""
    delta = gen.stream_delta(ch)
    if readers is None:
        return delta, None
    delta = readers[ch.index].feed(delta)
    if ch.finish_reason is None:
        return delta, None
    calls = readers[ch.index].finish(ch.finish_reason == "stop")
    return delta + (calls.content or ""), calls
