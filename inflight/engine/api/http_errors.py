"""What every route of an inflight server shares: errors in OpenAI's shape (`BadRequest`, the app's exception
handlers) and the access rules as FastAPI dependencies (`Auth`: the API key, local-only admin routes)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inflight.engine.core import VersionNotReached
from inflight.engine.api.guards import MISSING_KEY, QueueFull

log = logging.getLogger("inflight.engine.api.server")
LOCAL_HOSTS = {"127.0.0.1", "::1", "localhost", "testclient"}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def install_error_handlers(app: FastAPI, version_wait_s: float) -> None:
    """Every error the routes raise, answered as an OpenAI error body with its status."""

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
        return error_response(400, "invalid request: " + "; ".join(parts), param=None)

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(VersionNotReached)
    async def _stale(_: Request, exc: VersionNotReached) -> JSONResponse:
        return error_response(409, f"{exc} (within {version_wait_s:g} s)", "min_weight_version")

    @app.exception_handler(QueueFull)
    async def _busy(_: Request, exc: QueueFull) -> JSONResponse:
        log.info("429: %s", exc)
        response = error_response(429, str(exc), code="queue_full")
        response.headers["Retry-After"] = "1"
        return response

    # starlette's own (404, 405, FastAPI's body parser), of which FastAPI's HTTPException is a subclass
    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if isinstance(exc.__cause__, RecursionError):  # the JSON parser's nesting limit
            message = "malformed JSON body (nested too deeply)"
        elif exc.status_code in (404, 405):
            message = f"{message}: {request.method} {request.url.path}"
        response = error_response(exc.status_code, message)
        response.headers.update(exc.headers or {})  # e.g. a 405's Allow
        return response


class Auth:
    """The server's access rules, as FastAPI dependencies: `key` ('Authorization: Bearer KEY' when the server has an
    API key; every route but /health) and `admin` (the weight routes: local clients only unless allowed)."""

    def __init__(self, api_key: str | None = None, allow_remote_admin: bool = False):
        self.api_key, self.allow_remote_admin = api_key, allow_remote_admin

    async def key(self, request: Request) -> None:
        if self.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            log.warning("401 %s %s from %s: missing or wrong API key", request.method, request.url.path,
                        request.client.host if request.client else "?")
            raise HTTPException(401, MISSING_KEY)

    async def admin(self, request: Request) -> None:
        host = request.client.host if request.client else ""
        if not self.allow_remote_admin and host not in LOCAL_HOSTS:
            log.warning("403 %s from %s: admin endpoints are local-only", request.url.path, host)
            raise HTTPException(403, "admin endpoints accept local clients only (serve --allow-remote-admin)")
