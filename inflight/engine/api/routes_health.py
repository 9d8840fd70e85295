"""Health and metrics of an inflight server: /health (open to everyone: load balancers and the launcher's start-up
wait) and /metrics (Prometheus text, behind the API key; what it holds: metrics.py), as a FastAPI router."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from inflight.engine.api.http_errors import Auth
from inflight.engine.api.metrics import ServerMetrics

TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format, the one generate_latest writes


def health_router(engine: Any, auth: Auth, metrics: ServerMetrics) -> APIRouter:
    """/health (no key) and /metrics (`metrics`' registry in Prometheus text, behind `auth.key`)."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": engine.model_name, "version": engine.version}

    @router.get("/metrics", dependencies=[Depends(auth.key)])
    async def metrics_route() -> Response:
        return Response(metrics.text(), media_type=TEXT_FORMAT)

    return router
