"""Route chat requests over several inference servers: least outstanding requests first, a concurrency limit per
server, retries with exponential backoff, and servers that stop answering taken out of rotation until a probe
(GET /health) finds them back.

    pool = ServerPool(["http://127.0.0.1:8100", "http://127.0.0.1:8101"], concurrency_per_server=64)
    completions = await pool.chat({"messages": [...], "n": 8, "max_tokens": 16, "logprobs": True})
    await pool.aclose()

HTTP is aiohttp: httpx's async connection pool re-checks every pooled connection for every queued request, which
cost the actor ~60% of a core at 64 concurrent requests (py-spy, CPU demo); aiohttp's connector does not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from inflight import backends
from inflight.actor.response_parsers import Completion, get_adapter

log = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    """A request that could not be completed on any server within its retries."""


class BadRequest(RequestFailed):
    """The server rejected the request itself (4xx): retrying cannot help."""


@dataclass
class _Server:
    url: str
    outstanding: int = 0
    healthy: bool = True
    completed: int = 0
    errors: int = 0
    probe: asyncio.Task | None = field(default=None, repr=False)


class ServerPool:
    def __init__(
        self,
        urls: list[str],
        *,
        api_key: str | None = None,
        concurrency_per_server: int = 64,
        request_timeout_s: float = 120.0,
        retries: int = 5,
        backoff_s: float = 0.2,
        probe_interval_s: float = 0.5,
        adapter: str = backends.BUILTIN,
    ):
        if not urls:
            raise ValueError("ServerPool needs at least one server url")
        if concurrency_per_server < 1:
            raise ValueError("concurrency_per_server must be >= 1")
        self.servers = [_Server(u.rstrip("/")) for u in urls]
        self.concurrency = concurrency_per_server
        self.timeout_s = request_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.probe_interval_s = probe_interval_s
        self.parse = get_adapter(adapter)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._max_connections = concurrency_per_server * len(urls) + 8
        self._http: aiohttp.ClientSession | None = None  # created inside the running loop, on first use
        self._model: str | None = None
        self._changed: asyncio.Condition | None = None  # created lazily inside the running loop

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0)
            self._http = aiohttp.ClientSession(headers=self._headers, connector=connector,
                                               timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._http

    async def _get(self, url: str, timeout_s: float | None = None) -> tuple[int, bytes]:
        kw: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=timeout_s)} if timeout_s else {}
        async with self.http.get(url, **kw) as r:
            return r.status, await r.read()

    # ---------------------------------------------------------------------------------------------------- routing
    @property
    def cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    @property
    def in_flight(self) -> int:
        return sum(s.outstanding for s in self.servers)

    @property
    def num_healthy(self) -> int:
        return sum(s.healthy for s in self.servers)

    async def _acquire(self, deadline: float) -> _Server:
        """The healthy server with the fewest outstanding requests and a free slot; waits for one."""
        async with self.cond:
            while True:
                free = [s for s in self.servers if s.healthy and s.outstanding < self.concurrency]
                if free:
                    best = min(free, key=lambda s: s.outstanding)
                    best.outstanding += 1
                    return best
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestFailed(f"no healthy server with a free slot ({self.num_healthy} healthy)")
                try:
                    await asyncio.wait_for(self.cond.wait(), timeout=left)
                except asyncio.TimeoutError:
                    pass

    async def _release(self, server: _Server) -> None:
        async with self.cond:
            server.outstanding -= 1
            self.cond.notify_all()

    async def _take_out(self, server: _Server, why: str) -> None:
        if server.healthy:
            log.warning("server %s out of rotation: %s", server.url, why)
            server.healthy = False
        if server.probe is None or server.probe.done():
            server.probe = asyncio.create_task(self._probe(server))

    async def _probe(self, server: _Server) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                if (await self._get(server.url + "/health", min(5.0, self.timeout_s)))[0] == 200:
                    break
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
        log.warning("server %s back in rotation", server.url)
        async with self.cond:
            server.healthy = True
            self.cond.notify_all()

    # ---------------------------------------------------------------------------------------------------- requests
    async def post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST to one server with routing, retries and backoff; returns the response JSON."""
        error = "no attempt made"
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            server = await self._acquire(time.monotonic() + self.timeout_s)
            try:
                async with self.http.post(server.url + path, json=payload) as r:
                    status, body = r.status, await r.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # refused, reset, timed out
                error = f"{server.url}: {type(exc).__name__}: {exc}"
                server.errors += 1
                await self._take_out(server, error)
                continue
            finally:
                await self._release(server)
            if status >= 500 or status == 429:  # 429: the server's queue is full; back off, retry
                error = f"{server.url}: HTTP {status}: {body[:200].decode(errors='replace')}"
                server.errors += 1
                continue
            if status >= 400:
                raise BadRequest(f"{server.url} rejected the request: HTTP {status}: "
                                 f"{body[:500].decode(errors='replace')}")
            server.completed += 1
            return orjson.loads(body)
        raise RequestFailed(f"request failed after {self.retries + 1} attempts; last error: {error}")

    async def model_name(self) -> str:
        """The model id the servers serve (GET /v1/models of the first server that answers; asked once)."""
        if self._model is not None:
            return self._model
        error = ""
        for s in sorted(self.servers, key=lambda s: not s.healthy):
            try:
                status, body = await self._get(s.url + "/v1/models")
                if status != 200:
                    raise ValueError(f"HTTP {status}: {body[:200].decode(errors='replace')}")
                self._model = str(orjson.loads(body)["data"][0]["id"])
                return self._model
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as exc:
                error = f"{s.url}: {type(exc).__name__}: {exc}"
        raise RequestFailed(f"no server told its model name; last error: {error}")

    async def chat(self, payload: dict[str, Any]) -> list[Completion]:
        """One /v1/chat/completions request; the choices as `Completion`s (tokens exactly as the server sent)."""
        return self.parse(await self.post("/v1/chat/completions", payload))

    async def complete(self, payload: dict[str, Any]) -> list[Completion]:
        """One /v1/completions request (e.g. a prompt of token ids); the choices as `Completion`s."""
        return self.parse(await self.post("/v1/completions", payload))

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {"pool/in_flight": self.in_flight, "pool/healthy": self.num_healthy}
        for i, s in enumerate(self.servers):
            out[f"pool/server{i}/completed"] = s.completed
            out[f"pool/server{i}/errors"] = s.errors
        return out

    async def aclose(self) -> None:
        for s in self.servers:
            if s.probe is not None:
                s.probe.cancel()
        if self._http is not None:
            await self._http.close()
            self._http = None
