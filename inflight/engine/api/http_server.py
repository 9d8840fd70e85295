"""How inflight's servers run under uvicorn (`inflight serve`, the vLLM backend, the Ray server actor): one
`uvicorn_config` for all of them, with what uvicorn does not do by itself (docs/reliability.md):

- a deadline for a request's headers (`header_timeout_s`, from the connection's start or the request's first
  byte): uvicorn times out idle keep-alive connections only, so a client that sends half a request line, or
  nothing, would hold its connection forever;
- no proxy headers: uvicorn would otherwise take a loopback client's `X-Forwarded-For` as the client's address,
  which the local-only admin rule and the process-group address rule read.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("inflight.engine.api.server")


class HeaderDeadline(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing a connection whose request headers are not complete `header_timeout_s`
    after it opened (or after the request's first byte, on a kept-alive connection). Subclassed per server by
    `with_header_timeout`, since uvicorn builds protocols from its config only."""

    header_timeout_s = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:  # a request on a kept-alive connection (the first is armed at connect)
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.info("closing a connection from %s: request headers not complete within %g s",
                     self.client[0] if self.client else "?", self.header_timeout_s)
            self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderDeadline]:
    return type("HeaderDeadline", (HeaderDeadline,), {"header_timeout_s": float(seconds)})


def uvicorn_config(app: Any, *, host: str, port: int, log_level: str, header_timeout_s: float = 10.0) -> uvicorn.Config:
    """One worker process (the engine owns the model); a big backlog so 1,000 concurrent clients can connect."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, backlog=4096,
                          timeout_keep_alive=30, proxy_headers=False, http=with_header_timeout(header_timeout_s))
