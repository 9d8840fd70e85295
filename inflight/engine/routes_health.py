"""Health and metrics of an inflight server: /health (open to everyone: load balancers and the launcher's start-up
wait) and /metrics (Prometheus text, behind the API key), as a FastAPI router."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from inflight.engine.http_errors import Auth


def health_router(engine: Any, auth: Auth, metrics: Callable[[], str]) -> APIRouter:
    """/health (no key) and /metrics (`metrics()`: the Prometheus text, behind `auth.key`)."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": engine.model_name, "version": engine.version}

    @router.get("/metrics", dependencies=[Depends(auth.key)])
    async def metrics_route() -> PlainTextResponse:
        return PlainTextResponse(metrics())

    return router


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
