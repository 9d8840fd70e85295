"""HTTP server of the built-in engine: the OpenAI-compatible API, metrics, and the weight-update contract
(docs/inference-contract.md). `create_app(engine)` returns a FastAPI app; `inflight serve` runs it with uvicorn.

The app is assembled from routers, one per idea, that other backends reuse (the vLLM backend serves the same OpenAI
routes and health over its own engine, and the weight routes over its own receiver):
    routes_openai.py   /v1/chat/completions, /v1/completions, /v1/models
    routes_weights.py  /init_process_group, /request_weight_update, /check_weight_update
    routes_health.py   /health, /metrics
and one set of access rules and error handlers (http_errors.py: `Auth` as FastAPI dependencies, `BadRequest`)."""

from __future__ import annotations

import inspect
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from inflight.engine.guards import Admission, BodyLimit
from inflight.engine.http_errors import Auth, install_error_handlers
from inflight.engine.routes_health import health_router, prometheus_text
from inflight.engine.routes_openai import openai_router
from inflight.engine.routes_weights import weights_router
from inflight.engine.weight_receiver import WeightReceiver
from inflight.heap import freeze_startup_objects


def _no_telemetry() -> dict[str, Any]:
    """FastAPI >= 0.16x checks for OpenTelemetry providers on every request (~7% of the server's time on short
    requests); inflight exports no traces, so it is turned off where FastAPI has the setting."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


def base_app(engine: Any, *, manage_engine: bool = True, max_body_bytes: int = 8 * 2**20,
             version_wait_s: float = 300.0, api_key: str | None = None, body_timeout_s: float = 30.0) -> FastAPI:
    """An app with no routes yet: the engine's lifespan (`manage_engine`: started with the app, stopped at
    shutdown), the server's edge (guards.BodyLimit: the API key checked before a body is read, so on every route but
    /health, FastAPI's /docs, /redoc and /openapi.json included; 413; 408 after `body_timeout_s`) and the error
    handlers. Backends add the routers they serve."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            engine.start()
        freeze_startup_objects()  # the model, tokenizer and imports: out of every later full collection
        yield
        if manage_engine:
            engine.stop()

    app = FastAPI(title="inflight engine", lifespan=lifespan, **_no_telemetry())
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, api_key=api_key, body_timeout_s=body_timeout_s)
    install_error_handlers(app, version_wait_s)
    return app


def create_app(engine: Any, api_key: str | None = None, *, allow_remote_admin: bool = False,
               max_n: int | None = None, manage_engine: bool = True, device: str = "cpu",
               max_waiting: int | None = None, max_body_bytes: int = 8 * 2**20, reject_nonfinite: bool = True,
               own_port: int | None = None, version_wait_s: float = 300.0, tool_call_parser: str = "auto",
               body_timeout_s: float = 30.0) -> FastAPI:
    """The server app. `manage_engine`: start the engine with the app and stop it at shutdown.
    Protections (docs/reliability.md): `max_waiting` sequences may queue beyond the running batch (None: no
    limit), more get 429; bodies over `max_body_bytes` get 413, slower than `body_timeout_s` 408; `reject_nonfinite`
    refuses weight updates holding NaN/Inf; `own_port` (the port we listen on) may not be named as a process-group
    master port; a request whose `min_weight_version` the weights have not reached within `version_wait_s` gets 409.
    `tool_call_parser` reads tool calls out of chat replies (routes_openai.py)."""
    app = base_app(engine, manage_engine=manage_engine, max_body_bytes=max_body_bytes, version_wait_s=version_wait_s,
                   api_key=api_key, body_timeout_s=body_timeout_s)
    receiver = WeightReceiver(engine, device=device, reject_nonfinite=reject_nonfinite)
    app.state.receiver = receiver
    admission = Admission(int(getattr(engine, "max_batch", 128)), max_waiting)
    app.state.admission = admission
    auth = Auth(api_key, allow_remote_admin)
    app.include_router(openai_router(engine, admission, auth, max_n=max_n, version_wait_s=version_wait_s,
                                     tool_call_parser=tool_call_parser))
    app.include_router(health_router(engine, auth, lambda: prometheus_text(engine.stats(), receiver.updates,
                                                                           admission.rejected)))
    app.include_router(weights_router(receiver, auth, limits=engine, own_port=own_port))
    return app
