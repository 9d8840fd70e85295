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

from inflight.config.engine import EngineSettings
from inflight.engine.api.guards import Admission, BodyLimit
from inflight.engine.api.http_errors import Auth, install_error_handlers
from inflight.engine.api.metrics import ServerMetrics
from inflight.engine.api.routes_health import health_router
from inflight.engine.api.routes_openai import openai_router
from inflight.engine.api.routes_weights import weights_router
from inflight.engine.weights.receiver import WeightReceiver
from inflight.process import freeze_startup_objects


def _no_telemetry() -> dict[str, Any]:
    """FastAPI >= 0.16x checks for OpenTelemetry providers on every request (~7% of the server's time on short
    requests); inflight exports no traces, so it is turned off where FastAPI has the setting."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


def base_app(engine: Any, settings: EngineSettings | None = None, *, manage_engine: bool = True) -> FastAPI:
    """An app with no routes yet: the engine's lifespan (`manage_engine`: started with the app, stopped at
    shutdown), the server's edge (guards.BodyLimit: the API key checked before a body is read, so on every route but
    /health, FastAPI's /docs, /redoc and /openapi.json included; 413 over `max_body_bytes`; 408 after
    `body_timeout_s`) and the error handlers, by `settings` (config/engine.py). Backends add the routers they serve."""
    s = settings or EngineSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            engine.start()
        freeze_startup_objects()  # the model, tokenizer and imports: out of every later full collection
        yield
        if manage_engine:
            engine.stop()

    app = FastAPI(title="inflight engine", lifespan=lifespan, **_no_telemetry())
    app.add_middleware(BodyLimit, max_bytes=s.max_body_bytes, api_key=s.api_key or None,
                       body_timeout_s=s.body_timeout_s)
    install_error_handlers(app, s.version_wait_s)
    return app


def create_app(engine: Any, settings: EngineSettings | None = None, *, device: str = "cpu",
               own_port: int | None = None, manage_engine: bool = True, max_n: int | None = None) -> FastAPI:
    """The server app over `engine`, by `settings` (config/engine.py: the API key and admin rule, the protections
    of docs/reliability.md, the tool-call parser). `device`: where weight updates go; `own_port`: the port we listen
    on, which may not be named as a process-group master port; `manage_engine`: start the engine with the app and
    stop it at shutdown."""
    s = settings or EngineSettings()
    app = base_app(engine, s, manage_engine=manage_engine)
    receiver = WeightReceiver(engine, device=device, reject_nonfinite=s.reject_nonfinite)
    app.state.receiver = receiver
    admission = Admission(int(getattr(engine, "max_batch", s.max_batch)), None if s.max_waiting < 0 else s.max_waiting)
    app.state.admission = admission
    auth = Auth(s.api_key or None, s.allow_remote_admin)
    metrics = ServerMetrics(engine, receiver, admission)  # the app's own registry
    app.include_router(openai_router(engine, admission, auth, max_n=max_n, version_wait_s=s.version_wait_s,
                                     tool_call_parser=s.tool_call_parser, metrics=metrics))
    app.include_router(health_router(engine, auth, metrics))
    app.include_router(weights_router(receiver, auth, limits=engine, own_port=own_port, metrics=metrics))
    return app
