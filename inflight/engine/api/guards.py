"""Protections of the built-in server against overload and hostile input (docs/reliability.md):

- `BodyLimit`: an ASGI middleware that checks the API key from the headers (401) before reading a body, and refuses
  bodies over `max_bytes` (413) or slower than `body_timeout_s` (408) before the app parses them.
- `Admission`: the queue limit. At most `max_batch + max_waiting` sequences (a request with n choices counts n) may
  be admitted at once; one more gets 429 with Retry-After, instead of growing the engine's queue without bound.
- `check_master_address`: where a `/init_process_group` request may make the server connect (see its docstring).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import socket
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
log = logging.getLogger("inflight.engine.api.server")


class BodyLimit:
    """The server's edge, before any route runs (docs/reliability.md, "Hostile input on the HTTP API"):

    - with an API key, a request without it gets 401 from its headers alone, its body never read (/health stays
      open): unauthenticated clients cannot make the server hold their bodies;
    - a body must arrive within `body_timeout_s` (else 408) and hold at most `max_bytes` (else 413);
    - the body read is replayed to the app; later `receive()` calls go to the server, so disconnect detection keeps
      working.
    Refusals close the connection (the rest of the body is never read)."""

    def __init__(self, app: Any, max_bytes: int, api_key: str | None = None, body_timeout_s: float = 30.0):
        self.app, self.max_bytes, self.body_timeout_s = app, max_bytes, body_timeout_s
        try:  # as starlette reads headers (latin-1), so this check and the routes' agree
            self._expected = None if api_key is None else f"Bearer {api_key}".encode("latin-1")
        except UnicodeEncodeError:
            self._expected = b""  # a key no header can carry: every request is refused, as by the routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._expected is not None and not self._authorized(scope):
            client = (scope.get("client") or ("?",))[0]
            log.warning("401 %s %s from %s: missing or wrong API key", scope["method"], scope["path"], client)
            return await refuse(send, 401, MISSING_KEY, None)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if scope["method"] in ("GET", "HEAD", "OPTIONS") and declared in (None, b"0") \
                and b"transfer-encoding" not in headers:  # no body (one sent anyway is read, in time, as any)
            return await self.app(scope, receive, send)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while size <= self.max_bytes:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            log.warning("408 %s %s from %s: body not received within %g s (%d bytes)", scope["method"],
                        scope["path"], (scope.get("client") or ("?",))[0], self.body_timeout_s, size)
            return await refuse(send, 408, f"request body not received within {self.body_timeout_s:g} s (serve "
                                           "--body-timeout-s)", "body_timeout")
        if size > self.max_bytes:  # a chunked body without (or lying about) its length
            return await self._too_large(send)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, scope: Scope) -> bool:
        if scope["path"] == "/health" and scope["method"] in ("GET", "HEAD"):
            return True
        got = next((v for k, v in scope.get("headers") or [] if k == b"authorization"), b"")
        return hmac.compare_digest(got, self._expected or b"")

    async def _too_large(self, send: Send) -> None:
        await refuse(send, 413, f"request body over the server's limit of {self.max_bytes} bytes (serve "
                                f"--max-body-bytes)", "body_too_large")


MISSING_KEY = "missing or invalid API key (send 'Authorization: Bearer KEY')"


async def refuse(send: Send, status: int, message: str, code: str | None) -> None:
    """An OpenAI error body, and the connection closed after it (a body may be left unread)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class QueueFull(Exception):
    pass


class Admission:
    """Counts admitted sequences. Runs on the server's event loop only, so no lock is needed."""

    def __init__(self, max_batch: int, max_waiting: int | None):
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self.admitted = 0  # sequences of requests being answered now
        self.rejected = 0  # requests refused with 429 since start

    @property
    def capacity(self) -> int | None:
        return None if self.max_waiting is None else self.max_batch + self.max_waiting

    def reserve(self, n: int) -> Callable[[], None]:
        """Admit n sequences or raise QueueFull; returns an idempotent release()."""
        cap = self.capacity
        if cap is not None and self.admitted + n > cap:
            self.rejected += 1
            raise QueueFull(f"server busy: {self.admitted} sequences admitted, limit {cap} (max_batch "
                            f"{self.max_batch} + max_waiting {self.max_waiting}); retry later")
        self.admitted += n
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.admitted -= n

        return release


def _is_loopback(host: str) -> bool:
    if host in ("localhost", "testclient"):  # testclient: starlette's in-process client
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_master_address(address: str, port: int, client_host: str, own_port: int | None = None) -> str:
    """The rule for `/init_process_group` (the server connects to master_address:master_port as a TCPStore client):

    - the master address must resolve to loopback addresses or to the requesting client's own address: a caller
      can point the server at a store on its own host, never at a third host (no request forgery to other hosts);
    - the port must be unprivileged (>= 1024: ports below belong to system services) and not the server's own.

    Returns the resolved IP to connect to (connecting by that IP, not the name, defeats DNS rebinding); raises
    ValueError naming the problem."""
    if port < 1024:
        raise ValueError(f"master_port {port} is privileged (< 1024); use a port the trainer owns")
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"master_address {address!r} does not resolve: {e}") from None
    ips = sorted({str(info[4][0]) for info in infos})  # the host of an IPv4 or IPv6 address (a str)
    allowed = [ip for ip in ips if _is_loopback(ip) or ip == client_host]
    if not allowed or len(allowed) != len(ips):
        raise ValueError(f"master_address {address!r} ({', '.join(ips)}) is neither loopback nor the requesting "
                         f"client's address {client_host!r}: the trainer must host the store on its own host")
    if own_port is not None and port == own_port and all(_is_loopback(ip) for ip in allowed):
        raise ValueError(f"master_port {port} is this server's own port")
    return allowed[0]
