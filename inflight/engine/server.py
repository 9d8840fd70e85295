"""HTTP server of the built-in engine: the OpenAI-compatible API, metrics, and the weight-update contract
(docs/inference-contract.md). `create_app(engine)` returns a FastAPI app; `inflight serve` runs it with uvicorn."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import orjson
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from inflight.contracts import InitProcessGroupRequest, WeightUpdateRequest
from inflight.engine import openai_api as oa
from inflight.engine.core import VersionNotReached
from inflight.engine.guards import Admission, BodyLimit, QueueFull, check_master_address
from inflight.engine.request import Choice, Generation
from inflight.engine.ipc_receiver import ipc_local_only  # cuda_ipc: handles from this host only
from inflight.engine.weight_receiver import WeightReceiver, WeightUpdateError
from inflight.heap import freeze_startup_objects

log = logging.getLogger("inflight.engine.server")
LOCAL_HOSTS = {"127.0.0.1", "::1", "localhost", "testclient"}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


class _FastJSON(JSONResponse):
    """Completions with per-token logprobs are mostly JSON encoding: orjson does it ~5x faster than json."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _no_telemetry() -> dict[str, Any]:
    """FastAPI >= 0.16x checks for OpenTelemetry providers on every request (~7% of the server's time on short
    requests); inflight exports no traces, so it is turned off where FastAPI has the setting."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


def create_app(engine: Any, api_key: str | None = None, *, allow_remote_admin: bool = False,
               max_n: int | None = None, manage_engine: bool = True, device: str = "cpu",
               max_waiting: int | None = None, max_body_bytes: int = 8 * 2**20, reject_nonfinite: bool = True,
               own_port: int | None = None, version_wait_s: float = 300.0) -> FastAPI:
    """The server app. `manage_engine`: start the engine with the app and stop it at shutdown.
    Protections (docs/reliability.md): `max_waiting` sequences may queue beyond the running batch (None: no
    limit), more get 429; bodies over `max_body_bytes` get 413; `reject_nonfinite` refuses weight updates holding
    NaN/Inf; `own_port` (the port we listen on) may not be named as a process-group master port; a request whose
    `min_weight_version` the weights have not reached within `version_wait_s` gets 409."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            engine.start()
        freeze_startup_objects()  # the model, tokenizer and imports: out of every later full collection
        yield
        if manage_engine:
            engine.stop()

    app = FastAPI(title="inflight engine", lifespan=lifespan, **_no_telemetry())
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    receiver = WeightReceiver(engine, device=device, reject_nonfinite=reject_nonfinite)
    app.state.receiver = receiver
    admission = Admission(int(getattr(engine, "max_batch", 128)), max_waiting)
    app.state.admission = admission
    limit_n = max_n or int(getattr(engine, "max_batch", 128))
    tok_cache: dict[int, str] = {}

    # ---- errors and auth --------------------------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            if e.get("type") == "json_invalid":
                parts.append(f"malformed JSON body ({e.get('ctx', {}).get('error', e.get('msg'))})")
            elif not loc and e.get("type") == "model_attributes_type":
                parts.append("the body must be a JSON object (send Content-Type: application/json)")
            else:
                parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        return _error(400, "invalid request: " + "; ".join(parts), param=None)

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(VersionNotReached)
    async def _stale(_: Request, exc: VersionNotReached) -> JSONResponse:
        return _error(409, f"{exc} (within {version_wait_s:g} s)", "min_weight_version")

    @app.exception_handler(QueueFull)
    async def _busy(_: Request, exc: QueueFull) -> JSONResponse:
        log.info("429: %s", exc)
        response = _error(429, str(exc), code="queue_full")
        response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    async def auth(request: Request) -> None:
        if api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {api_key}":
            log.warning("401 %s %s from %s: missing or wrong API key", request.method, request.url.path,
                        request.client.host if request.client else "?")
            raise HTTPException(401, "missing or invalid API key (send 'Authorization: Bearer KEY')")

    async def admin(request: Request) -> None:
        host = request.client.host if request.client else ""
        if not allow_remote_admin and host not in LOCAL_HOSTS:
            log.warning("403 %s from %s: admin endpoints are local-only", request.url.path, host)
            raise HTTPException(403, "admin endpoints accept local clients only (serve --allow-remote-admin)")

    async def update_limits(request: Request) -> None:
        """A valid update names each parameter at most once: refuse longer lists before they are validated."""
        try:
            body = await request.json()
        except Exception:
            return  # malformed JSON: the body validation answers 400 with the parser's message
        params = body.get("params") if isinstance(body, dict) else None
        # tied aliases count: a list naming them too gets the 400 that names the canonical name, not a 413
        cap = len(engine.param_specs()) + len(getattr(engine, "tied_aliases", None) or {})
        if isinstance(body, dict) and body.get("adapter") is not None:
            cap *= 2  # an adapter update names two tensors (lora_A, lora_B) per adapted weight
        if isinstance(params, list) and len(params) > cap:
            raise HTTPException(413, f"'params' lists {len(params)} tensors; the model has {cap} parameters")

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
        from inflight.engine.core import SamplingParams

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
        return SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0), max_tokens=max_new,
            stop_token_ids=list(req.stop_token_ids), seed=req.seed, n=req.n,
            top_logprobs=req.num_top_logprobs, ignore_eos=req.ignore_eos,  # type: ignore[attr-defined]
            priority=req.priority,
        )

    @functools.lru_cache(maxsize=4096)  # RL asks for the same prompts again (held-out sets, retries)
    def render_chat(msgs: tuple[tuple[str, str], ...], add_generation_prompt: bool) -> tuple[int, ...]:
        if not getattr(engine.tokenizer, "chat_template", None):
            raise BadRequest(f"model {engine.model_name!r} has no chat template, so chat messages cannot be rendered: "
                             "use /v1/completions with a prompt, or serve a chat model (or add chat_template.jinja "
                             "to the model folder)", "messages")
        try:
            ids = engine.tokenizer.apply_chat_template(
                [{"role": r, "content": c} for r, c in msgs], add_generation_prompt=add_generation_prompt,
                tokenize=True, return_dict=False)
        except Exception as e:  # a template may raise on e.g. a role order it does not allow
            raise BadRequest(f"the chat template rejected the messages: {e}", "messages") from e
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return tuple(int(t) for t in ids)

    def chat_prompt(req: oa.ChatCompletionRequest) -> list[int]:
        try:
            msgs = tuple((m.role, m.text()) for m in req.messages)
        except ValueError as e:
            raise BadRequest(str(e), "messages") from e
        return list(render_chat(msgs, req.add_generation_prompt))

    def text_prompt(req: oa.CompletionRequest) -> list[int]:
        p = req.single_prompt()
        if isinstance(p, str):
            try:
                return list(engine.tokenizer.encode(p, add_special_tokens=False))
            except Exception as e:  # e.g. lone surrogates that JSON allows but UTF-8 does not
                raise BadRequest(f"the prompt could not be tokenized: {e}", "prompt") from e
        vocab = int(getattr(engine, "vocab_size", len(engine.tokenizer)))
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"prompt token ids out of vocabulary (size {vocab}): {bad[:5]}", "prompt")
        return list(p)

    def choice_body(kind: str, ch: Choice, prompt_ids: list[int], top_n: int, want_lp: bool,
                    delta: str | None = None, new: slice | None = None) -> dict[str, Any]:
        sl = new or slice(0, len(ch.token_ids))
        ids, lps = ch.token_ids[sl], ch.logprobs[sl]
        lp = None
        if want_lp:
            toks = [tok_str(t) for t in ids]
            tops = [[(tok_str(t), v) for t, v in row[:top_n]] for row in ch.tops[sl]] if top_n else None
            lp = (oa.chat_logprobs if kind == "chat" else oa.completion_logprobs)(toks, lps, tops)
        text = ch.text if delta is None else delta
        body: dict[str, Any] = {"index": ch.index}
        if kind == "chat":
            if delta is None:
                body["message"] = {"role": "assistant", "content": text}
            else:
                body["delta"] = {"content": text} if text or ids else {}
        else:
            body["text"] = text
        body.update(logprobs=lp, finish_reason=ch.finish_reason, token_ids=ids, token_versions=ch.versions[sl])
        if delta is None or new is None or new.start == 0:
            body["prompt_token_ids"] = prompt_ids
        return body

    async def run_full(kind: str, request: Request, gen: Generation, model: str, top_n: int, want_lp: bool):
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
        body = [choice_body(kind, ch, gen.prompt_ids, top_n, want_lp) for ch in gen.choices]
        use = oa.usage(len(gen.prompt_ids), sum(len(c.token_ids) for c in gen.choices))
        return _FastJSON(oa.envelope(kind, f"{kind}-{gen.rid}", model, body, use))  # type: ignore[arg-type]

    async def run_stream(kind: str, gen: Generation, model: str, top_n: int, want_lp: bool, include_usage: bool):
        """A request held for its weights waits here for its first event: a version that never comes is a 409, not
        a stream that breaks off after its headers."""
        rid = f"{kind}-{gen.rid}"

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
                if new.start == new.stop and not delta and ch.finish_reason is None:
                    continue
                done_tokens[ch.index] = new.stop
                yield sse([choice_body(kind, ch, gen.prompt_ids, top_n, want_lp, delta=delta, new=new)])
            if include_usage:
                use = oa.usage(len(gen.prompt_ids), sum(len(c.token_ids) for c in gen.choices))
                yield sse([], use)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    async def complete(kind: str, request: Request, req: oa.ChatCompletionRequest | oa.CompletionRequest):
        check_model(req.model)
        prompt_ids = chat_prompt(req) if isinstance(req, oa.ChatCompletionRequest) else text_prompt(req)
        params = sampling(req, prompt_ids)
        want_lp = req.logprobs is not None and req.logprobs is not False
        release = admission.reserve(req.n)  # after validation: a bad request is a 400, never a 429
        try:
            # a request for weights not here yet is held by the engine (a version that never comes must not hold a
            # connection and a queue place forever: 409 after version_wait_s)
            min_version = req.min_weight_version or 0
            gen = Generation(engine, prompt_ids, params, req.stops, req.n, want_text=req.stream,
                              min_version=min_version if min_version > engine.version else 0,
                              version_wait_s=version_wait_s)
            if req.stream:
                inc = bool(req.stream_options and req.stream_options.include_usage)
                stream = await run_stream(kind, gen, req.model, req.num_top_logprobs, want_lp, inc)
                return _Releasing(stream, release)
            return await run_full(kind, request, gen, req.model, req.num_top_logprobs, want_lp)
        finally:
            if not req.stream:
                release()

    # ---- OpenAI API -------------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(req: oa.ChatCompletionRequest, request: Request):
        return await complete("chat", request, req)

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(req: oa.CompletionRequest, request: Request):
        return await complete("text", request, req)

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "inflight", "max_model_len": engine.max_model_len,
                                            "version": engine.version}]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": engine.model_name, "version": engine.version}

    @app.get("/metrics", dependencies=[Depends(auth)])
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus_text(engine.stats(), receiver.updates, admission.rejected))

    # ---- weight-update contract -------------------------------------------------------------------------------
    @app.post("/init_process_group", dependencies=[Depends(auth), Depends(admin)])
    async def init_process_group(req: InitProcessGroupRequest, request: Request) -> dict[str, Any]:
        client = request.client.host if request.client else ""
        try:  # getaddrinfo blocks: off the event loop
            ip = await asyncio.to_thread(check_master_address, req.master_address, req.master_port, client, own_port)
        except ValueError as e:
            log.warning("403 /init_process_group from %s: %s", client, e)
            raise BadRequest(str(e), "master_address", status=403) from e
        try:
            return await receiver.init_process_group(req, connect_to=ip)
        except WeightUpdateError as e:
            raise BadRequest(str(e), status=e.status) from e
        except Exception as e:  # rendezvous failed (timeout, unreachable store)
            raise BadRequest(f"could not join the process group: {e}", status=500) from e

    @app.post("/request_weight_update", dependencies=[Depends(auth), Depends(admin), Depends(update_limits),
                                                     Depends(ipc_local_only)])
    async def request_weight_update(req: WeightUpdateRequest) -> dict[str, Any]:
        try:
            return await receiver.update(req)
        except WeightUpdateError as e:
            log.warning("weight update v%d rejected: %s", req.version, e)
            raise BadRequest(str(e), status=e.status) from e

    @app.post("/check_weight_update", dependencies=[Depends(auth), Depends(admin), Depends(update_limits),
                                                     Depends(ipc_local_only)])
    async def check_weight_update(req: WeightUpdateRequest) -> dict[str, Any]:
        """Optional dry run: the same checks as /request_weight_update, nothing received or changed."""
        try:
            receiver.validate(req)
        except WeightUpdateError as e:
            raise BadRequest(str(e), status=e.status) from e
        return {"ok": True}

    return app


class _Releasing(StreamingResponse):
    """A streaming response that frees its admission slot however the stream ends (even if never started)."""

    def __init__(self, inner: StreamingResponse, release: Any):
        super().__init__(inner.body_iterator, media_type=inner.media_type)
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def prometheus_text(stats: dict[str, Any], updates: int, rejected: int = 0) -> str:
    rows = [
        ("inflight_running_requests", "gauge", "sequences being decoded", stats.get("running", 0)),
        ("inflight_waiting_requests", "gauge", "sequences waiting for a batch slot", stats.get("waiting", 0)),
        ("inflight_generated_tokens_total", "counter", "tokens generated", stats.get("generated_tokens_total", 0)),
        ("inflight_batch_occupancy", "gauge", "running / max batch", stats.get("batch_occupancy", 0.0)),
        ("inflight_weight_version", "gauge", "version of the loaded weights", stats.get("version", 0)),
        ("inflight_paused_seconds_total", "counter", "seconds generation was paused for weight updates",
         stats.get("paused_seconds_total", 0.0)),
        ("inflight_engine_steps_total", "counter", "engine steps", stats.get("steps", 0)),
        ("inflight_prefill_tokens_total", "counter", "prompt tokens run through the model (prefill, re-prefill)",
         stats.get("prefill_tokens_total", 0)),
        ("inflight_prefix_reused_tokens_total", "counter", "prompt tokens whose KV was reused from a finished "
         "sequence (not prefilled)", stats.get("prefix_reused_tokens_total", 0)),
        ("inflight_retained_sequences", "gauge", "finished sequences whose KV is kept for prefix reuse",
         stats.get("retained", 0)),
        ("inflight_weight_updates_total", "counter", "weight updates applied", updates),
        ("inflight_rejected_requests_total", "counter", "requests refused with 429 (queue limit)", rejected),
    ]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {float(value):g}"]
    return "\n".join(out) + "\n"
