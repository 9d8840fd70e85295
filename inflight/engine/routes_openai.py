"""The OpenAI-compatible API of an inflight server (docs/inference-contract.md): /v1/chat/completions,
/v1/completions and /v1/models, as a FastAPI router over any engine with the built-in engine's surface (the
built-in `InferenceEngine`, the vLLM backend's `VLLMEngine`)."""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from typing import Any, AsyncIterator

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from inflight.engine import openai_api as oa
from inflight.engine.chat_template import TemplateAbilities
from inflight.engine.guards import Admission
from inflight.engine.http_errors import Auth, BadRequest
from inflight.engine.prompts import Prompts
from inflight.engine.request import Choice, Generation
from inflight.engine.sampling import SamplingParams
from inflight.engine.tool_parser import CLOSE, HermesStream, Parsed, call_dict, parse_hermes

log = logging.getLogger("inflight.engine.server")


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
    and the text the server wrote at the start of the reply to force a call (tool_choice required / a function)."""

    def __init__(self, req: oa.ChatCompletionRequest, abilities: TemplateAbilities):
        self.names = req.tool_names
        self.parse = bool(self.names) and req.choice != "none"
        if self.parse and abilities.parser == "none":
            raise BadRequest(f"tool_choice {req.choice!r} needs a tool-call parser, and this server has none for its "
                             "chat template (serve with --tool-call-parser hermes, or send tool_choice 'none' to get "
                             "the reply as text)", "tool_choice")
        forced = req.choice in ("required", "named")
        self.opening = abilities.call_opening(req.forced_function) if forced else ""
        # one call only: the reply ends with it (the stop string is cut from the text; the parser accepts the
        # block left open by a model that ended there)
        self.stops = [CLOSE] if self.parse and (req.choice == "named" or not req.parallel_tool_calls) else []

    def parsed(self, ch: Choice) -> Parsed:
        return parse_hermes(self.opening + ch.text, self.names, finished=ch.finish_reason == "stop")


def openai_router(engine: Any, admission: Admission, auth: Auth, *, max_n: int | None = None,
                  version_wait_s: float = 300.0, tool_call_parser: str = "auto") -> APIRouter:
    """The OpenAI routes, every one behind `auth.key`. `admission` holds the queue limit (429); `max_n` caps a
    request's `n` (default: the engine's batch); a `min_weight_version` not reached in `version_wait_s` is a 409.
    `tool_call_parser` reads tool calls out of chat replies (auto: the one the chat template writes; none)."""
    router = APIRouter(dependencies=[Depends(auth.key)])
    limit_n = max_n or int(getattr(engine, "max_batch", 128))
    tok_cache: dict[int, str] = {}
    prompts = Prompts(engine)

    @functools.cache
    def abilities() -> TemplateAbilities:  # on first use: the engine's tokenizer is final by then
        return TemplateAbilities.of(engine.tokenizer, tool_call_parser)

    # ---- helpers ----------------------------------------------------------------------------------------------
    def tok_str(tid: int) -> str:
        s = tok_cache.get(tid)
        if s is None:
            s = tok_cache[tid] = engine.tokenizer.decode([tid])
        return s

    def check_model(name: str) -> None:
        if name != engine.model_name:
            raise BadRequest(f"model {name!r} does not exist; this server serves {engine.model_name!r}", "model",
                             code="model_not_found")

    def sampling(req: oa._Sampling, prompt_ids: list[int]) -> Any:
        ctx = engine.max_model_len
        if len(prompt_ids) == 0:
            raise BadRequest("the prompt is empty", "prompt")
        if len(prompt_ids) >= ctx:
            raise BadRequest(f"prompt has {len(prompt_ids)} tokens; the context is {ctx} tokens (prompt must be "
                             f"shorter to leave room for at least one generated token)", "messages",
                             code="context_length_exceeded")
        max_new = req.max_new_tokens  # type: ignore[attr-defined]
        if max_new is None:
            max_new = ctx - len(prompt_ids)
        elif len(prompt_ids) + max_new > ctx:
            raise BadRequest(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_new}) exceeds the context of "
                             f"{ctx} tokens", "max_tokens", code="context_length_exceeded")
        if req.n > limit_n:
            raise BadRequest(f"n={req.n} is over this server's limit of {limit_n}", "n")
        vocab = int(getattr(engine, "vocab_size", len(engine.tokenizer)))
        bad = [t for t in req.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"stop_token_ids out of vocabulary: {bad[:5]}", "stop_token_ids")
        if req.prompt_score_k is not None and not getattr(engine, "scores_prompts", False):
            raise BadRequest("this engine does not compute prompt logprobs (echo, prompt_logprobs)", "echo")
        return SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0), max_tokens=max_new,
            stop_token_ids=list(req.stop_token_ids), seed=req.seed, n=req.n,
            top_logprobs=req.num_top_logprobs, ignore_eos=req.ignore_eos,  # type: ignore[attr-defined]
            priority=req.priority, prompt_logprobs=req.prompt_score_k,
        )

    def chat_tools(req: oa.ChatCompletionRequest) -> ToolUse:
        """What the request does with tools, once the template is known to render what it holds."""
        can = abilities()
        if req.tools and not can.renders_tools:
            raise BadRequest(f"the chat template of {engine.model_name!r} has no tools section (it renders the same "
                             "prompt with and without tools), so the model would never see them: serve it with "
                             "--chat-template chatml_tools (ChatML models) or a template of your own that renders "
                             "`tools`", "tools")
        if any(m.tool_calls for m in req.messages) and not can.renders_tool_calls:
            raise BadRequest(f"the chat template of {engine.model_name!r} does not render an assistant message's "
                             "tool_calls: serve it with a template that does (--chat-template)", "messages")
        return ToolUse(req, can)

    def choice_body(kind: str, ch: Choice, prompt_ids: list[int], top_n: int, want_lp: bool,
                    delta: str | None = None, new: slice | None = None, tools: ToolUse | None = None,
                    calls: Parsed | None = None) -> dict[str, Any]:
        """One choice of a response (`delta`: of a stream chunk). `tools`: the reply is read for tool calls (whole;
        in a stream, `calls` holds the calls found when the choice ended)."""
        sl = new or slice(0, len(ch.token_ids))
        ids, lps = ch.token_ids[sl], ch.logprobs[sl]
        lp = None
        if want_lp:
            toks = [tok_str(t) for t in ids]
            tops = [[(tok_str(t), v) for t, v in row[:top_n]] for row in ch.tops[sl]] if top_n else None
            lp = (oa.chat_logprobs if kind == "chat" else oa.completion_logprobs)(toks, lps, tops)
        text = ch.text if delta is None else delta
        body: dict[str, Any] = {"index": ch.index}
        finish = ch.finish_reason
        if kind == "chat" and delta is None:
            body["message"] = {"role": "assistant", "content": text}
            if tools is not None and tools.parse:
                got = tools.parsed(ch)
                body["message"]["content"] = got.content
                if got.calls:
                    body["message"]["tool_calls"] = [call_dict(c, new_call_id()) for c in got.calls]
                    finish = "tool_calls"
        elif kind == "chat":
            body["delta"] = {"content": text} if text or ids else {}
            if calls is not None and calls.calls:
                body["delta"]["tool_calls"] = [call_dict(c, new_call_id(), i) for i, c in enumerate(calls.calls)]
                finish = "tool_calls"
        else:
            body["text"] = text
        body.update(logprobs=lp, finish_reason=finish, token_ids=ids, token_versions=ch.versions[sl])
        if delta is None or new is None or new.start == 0:
            body["prompt_token_ids"] = prompt_ids
        return body

    async def run_full(kind: str, request: Request, gen: Generation, model: str, top_n: int, want_lp: bool,
                       req: Any = None, tools: ToolUse | None = None):
        """Non-streaming: generate every choice; cancel when the client goes away."""

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
            log.info("client disconnected; request %s aborted", gen.rid)
            return JSONResponse({}, 499)
        work.result()
        body = [choice_body(kind, ch, gen.prompt_ids, top_n, want_lp, tools=tools) for ch in gen.choices]
        echo = getattr(req, "echo", False) and kind == "text"
        if echo or gen.prompt_scores is not None:
            text = req.single_prompt() if echo else None
            text = engine.tokenizer.decode(text) if isinstance(text, list) else text
            for b in body:
                oa.prompt_fields(b, gen.prompt_scores, gen.prompt_ids, text, req, tok_str)
        use = oa.usage(len(gen.prompt_ids), sum(len(c.token_ids) for c in gen.choices))
        return FastJSON(oa.envelope(kind, f"{kind}-{gen.rid}", model, body, use))  # type: ignore[arg-type]

    async def run_stream(kind: str, gen: Generation, model: str, top_n: int, want_lp: bool, include_usage: bool,
                         tools: ToolUse | None = None):
        """A request held for its weights waits here for its first event: a version that never comes is a 409, not
        a stream that breaks off after its headers. A reply read for tool calls streams its text up to a call; the
        calls come in the choice's last chunk (tool_parser.HermesStream)."""
        rid = f"{kind}-{gen.rid}"
        readers = [HermesStream(tools.names) for _ in gen.choices] if tools is not None and tools.parse else None
        if readers is not None:
            for r in readers:
                r.feed(tools.opening)  # type: ignore[union-attr]

        def sse(choices: list[dict], use: dict | None = None) -> bytes:
            return b"data: " + orjson.dumps(oa.envelope(kind, rid, model, choices, use, chunk=True)) + b"\n\n"  # type: ignore[arg-type]

        events = gen.events()
        first = [await anext(events)] if gen.gate else []

        async def choices() -> AsyncIterator[Choice]:
            for ch in first:
                yield ch
            async for ch in events:
                yield ch

        async def body() -> AsyncIterator[bytes]:
            if kind == "chat":  # OpenAI's first chunk announces the role
                yield sse([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for c in gen.choices])
            done_tokens = [0] * len(gen.choices)
            async for ch in choices():
                new = slice(done_tokens[ch.index], len(ch.token_ids))
                delta = gen.stream_delta(ch)
                calls = None
                if readers is not None:
                    delta = readers[ch.index].feed(delta)
                    if ch.finish_reason is not None:
                        calls = readers[ch.index].finish(ch.finish_reason == "stop")
                        delta += calls.content or ""
                if new.start == new.stop and not delta and ch.finish_reason is None:
                    continue
                done_tokens[ch.index] = new.stop
                yield sse([choice_body(kind, ch, gen.prompt_ids, top_n, want_lp, delta=delta, new=new,
                                       calls=calls)])
            if include_usage:
                use = oa.usage(len(gen.prompt_ids), sum(len(c.token_ids) for c in gen.choices))
                yield sse([], use)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    async def complete(kind: str, request: Request, req: oa.ChatCompletionRequest | oa.CompletionRequest):
        check_model(req.model)
        tools = chat_tools(req) if isinstance(req, oa.ChatCompletionRequest) else None
        if tools is not None:
            prompt_ids = await prompts.chat(req, tools.opening)  # type: ignore[arg-type]
        else:
            prompt_ids = await prompts.text(req)  # type: ignore[arg-type]
        params = sampling(req, prompt_ids)
        want_lp = req.logprobs is not None and req.logprobs is not False
        release = admission.reserve(req.n)  # after validation: a bad request is a 400, never a 429
        handed_over = False  # to the streaming response, which releases when it ends
        try:
            # a request for weights not here yet is held by the engine (a version that never comes must not hold a
            # connection and a queue place forever: 409 after version_wait_s)
            min_version = req.min_weight_version or 0
            stops = req.stops + [s for s in (tools.stops if tools else []) if s not in req.stops]
            gen = Generation(engine, prompt_ids, params, stops, req.n, want_text=req.stream,
                              min_version=min_version if min_version > engine.version else 0,
                              version_wait_s=version_wait_s)
            if req.stream:
                inc = bool(req.stream_options and req.stream_options.include_usage)
                # a stream's 409 (version not reached) is raised here, before the response exists
                stream = await run_stream(kind, gen, req.model, req.num_top_logprobs, want_lp, inc, tools)
                response = Releasing(stream, release)
                handed_over = True
                return response
            return await run_full(kind, request, gen, req.model, req.num_top_logprobs, want_lp, req, tools)
        finally:
            if not handed_over:  # every other way out: answered, refused, failed, cancelled
                release()

    # ---- OpenAI API -------------------------------------------------------------------------------------------
    @router.post("/v1/chat/completions")
    async def chat_completions(req: oa.ChatCompletionRequest, request: Request):
        return await complete("chat", request, req)

    @router.post("/v1/completions")
    async def completions(req: oa.CompletionRequest, request: Request):
        return await complete("text", request, req)

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "inflight", "max_model_len": engine.max_model_len,
                                            "version": engine.version}]}

    return router
