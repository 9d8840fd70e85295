"""A fourth inference backend, registered from this one file: the proof that adding a backend is one folder and one
registration (docs/backends.md, "Adding a backend"). Name it in INFLIGHT_BACKENDS=tests.toy_backend and every
process of a run knows it: `server.engine=toy`, `trainer.protocol=toy`, `actor.adapter=toy`.

Its server is the built-in engine behind an app this module assembles from the server's routers, started by its own
launcher with options of its own (`--toy-slots`, `--toy-context`: what server.max_batch and server.max_model_len
map to). Its protocol client is inflight's, over a process group; its adapter reads the built-in response shape.
Each part, when used, leaves a file `<role>-<pid>` in the folder TOY_BACKEND_MARKS names, so a test sees which
process used which part.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from inflight.backends import InferenceBackend, register

NAME = "toy"
MARKS = "TOY_BACKEND_MARKS"


def mark(role: str, detail: str = "") -> None:
    folder = os.environ.get(MARKS)
    if folder:
        (Path(folder) / f"{role}-{os.getpid()}").write_text(detail)


def options(s: Any, cuda: bool) -> list[str]:
    return ["--toy-slots", str(s.max_batch), "--toy-context", str(s.max_model_len)]


def main(argv: list[str]) -> int:
    """`inflight serve --engine toy --model DIR --host H --port P --toy-slots N --toy-context N`."""
    import uvicorn

    from inflight.engine.api.guards import Admission
    from inflight.engine.api.http_errors import Auth
    from inflight.engine.api.metrics import ServerMetrics
    from inflight.engine.api.routes_health import health_router
    from inflight.engine.api.routes_openai import openai_router
    from inflight.engine.api.routes_weights import weights_router
    from inflight.engine.api.server import base_app
    from inflight.engine.core import InferenceEngine
    from inflight.engine.weights.receiver import WeightReceiver

    p = argparse.ArgumentParser(prog="inflight serve --engine toy")
    for flag, kw in [("--model", dict(required=True)), ("--host", dict(default="127.0.0.1")),
                     ("--port", dict(type=int, default=8000)), ("--toy-slots", dict(type=int, default=8)),
                     ("--toy-context", dict(type=int, default=256)), ("--api-key", dict(default=None))]:
        p.add_argument(flag, **kw)
    args = p.parse_args(argv)
    engine = InferenceEngine(args.model, max_batch=args.toy_slots, max_model_len=args.toy_context, threads=1)
    receiver, admission, auth = WeightReceiver(engine), Admission(args.toy_slots, None), Auth(args.api_key)
    app, metrics = base_app(engine), ServerMetrics(engine, receiver, admission)
    app.include_router(openai_router(engine, admission, auth, metrics=metrics))
    app.include_router(health_router(engine, auth, metrics))
    app.include_router(weights_router(receiver, auth, limits=engine, own_port=args.port, metrics=metrics))
    mark("server", f"slots={engine.max_batch} context={engine.max_model_len}")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def check_config(cfg: Any) -> None:
    if cfg.trainer.weight_transport != "process_group":
        raise ValueError("trainer.protocol=toy sends weights over a process group only")


def make_client(cfg: Any, server_urls: list[str], common: dict[str, Any]) -> Any:
    from inflight.trainer.weight_sync.inflight import WeightSyncClient

    check_config(cfg)
    mark("protocol", ",".join(server_urls))
    return WeightSyncClient(server_urls, transport="process_group", **common)


_parsed = False


def parse(resp: dict[str, Any]) -> list[Any]:
    from inflight.actor.response_parsers import parse_builtin

    global _parsed
    if not _parsed:
        _parsed = True
        mark("adapter", str(resp.get("model")))
    return parse_builtin(resp)


BACKEND = register(InferenceBackend(
    name=NAME, launcher="tests.toy_backend:main", options="tests.toy_backend:options", protocol=NAME,
    protocol_module="tests.toy_backend", adapter="tests.toy_backend:parse"))
