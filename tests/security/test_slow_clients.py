"""Slow and unauthenticated clients of `inflight serve --api-key` (a real subprocess, on loopback, raw sockets where
a client must misbehave): half-sent headers are cut off, a body that does not arrive gets 408, a body without the key
gets 401 before it is read, /docs and the schema need the key, and X-Forwarded-For is not believed. After each
attack a normal request answers exactly as before, and the server's RSS is back within 10%."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from inflight.engine.serve import ServerProcess
from tests.servers import answers_normally, fingerprint, openai_error, rss_mb

KEY = "sl0w-client-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 8 * 2**20  # the default --max-body-bytes
HEADER_S = BODY_S = 1.0


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    args = ["--api-key", KEY, "--max-model-len", "64", "--no-prefix-reuse", "--header-timeout-s", str(HEADER_S),
            "--body-timeout-s", str(BODY_S)]
    with ServerProcess(str(tiny_model_dir), extra_args=args, env={"OMP_NUM_THREADS": "1"}) as p:
        p.port_ = int(p.url.rsplit(":", 1)[1])
        p.model, p.headers = httpx.get(p.url + "/v1/models", headers=AUTH).json()["data"][0]["id"], AUTH
        p.ref = fingerprint(p)
        yield p
        log = p.log_tail(100_000)
        assert "Traceback" not in log, log[log.find("Traceback") - 200: log.find("Traceback") + 2000]


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port_), timeout=10)


def read_until_closed(s: socket.socket, within: float) -> bytes | None:
    """What the server sent until it closed the connection; None if it still holds it open after `within` s."""
    s.settimeout(within)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        return None
    return got


def headers(path: str, length: int, key: bool) -> bytes:
    auth = f"Authorization: Bearer {KEY}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n{auth}"
            "\r\n").encode()


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


# ---- headers that do not complete in time ----------------------------------------------------------------------------
def test_half_sent_headers_are_closed_after_the_timeout(server):
    before = rss_mb(server.proc.pid)
    half = []
    for _ in range(300):
        s = connect(server)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        half.append(s)
    silent = [connect(server) for _ in range(20)]  # connect, send nothing
    kept = connect(server)  # a kept-alive connection whose second request stops halfway
    kept.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")
    kept.sendall(b"GET /v1/models HTTP/1.1\r\nHo")
    slow = connect(server)  # headers in pieces, complete within the timeout: answered
    for piece in (b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
        slow.sendall(piece)
        time.sleep(HEADER_S / 4)
    assert slow.recv(65536).startswith(b"HTTP/1.1 200")
    t0 = time.monotonic()
    for s in [*half, *silent, kept]:
        assert read_until_closed(s, within=HEADER_S + 5) is not None, "a connection with half-sent headers held open"
        s.close()
    print(f"{len(half) + len(silent) + 1} connections closed within {time.monotonic() - t0:.1f} s more")
    slow.close()
    after = rss_mb(server.proc.pid)
    assert after <= 1.10 * before, f"RSS grew {before:.0f} -> {after:.0f} MB"
    answers_normally(server)


# ---- a body that does not arrive in time -----------------------------------------------------------------------------
def test_body_that_does_not_arrive_gets_408(server):
    s = connect(server)
    s.sendall(headers("/v1/completions", 1000, key=True) + b'{"model": ')
    t0 = time.monotonic()
    reply = read_until_closed(s, within=BODY_S + 5)
    s.close()
    assert reply is not None, "a body that never arrived held its connection open"
    took = time.monotonic() - t0
    assert status_of(reply) == 408 and b'"code": "body_timeout"' in reply, reply[:300]
    assert BODY_S * 0.8 < took < BODY_S + 3, took
    answers_normally(server)


# ---- a body without the key is never read ----------------------------------------------------------------------------
def test_unauthenticated_body_is_refused_before_it_is_read(server):
    for auth in (b"", b"Authorization: Bearer wrong\r\n"):
        s = connect(server)
        head = headers("/v1/completions", LIMIT - 100, key=False).replace(b"\r\n\r\n", b"\r\n" + auth + b"\r\n")
        s.sendall(head + b"x" * 65536)  # the rest of the 8 MiB never comes
        reply = read_until_closed(s, within=5)
        s.close()
        assert reply is not None, "the server waited for the body of an unauthenticated request"
        assert status_of(reply) == 401 and b"API key" in reply, reply[:300]
    # whole 8 MiB bodies sent by clients that do not wait: 401, and none of them is held
    before = rss_mb(server.proc.pid)

    def post(_: int) -> None:
        r = httpx.post(server.url + "/v1/completions", content=b"x" * (LIMIT - 100), timeout=30,
                       headers={"content-type": "application/json"})
        openai_error(r, 401)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(post, range(20)))
    after = rss_mb(server.proc.pid)
    print(f"RSS {before:.0f} -> {after:.0f} MB over 20 unauthenticated 8 MiB bodies")
    assert after <= 1.10 * before, f"RSS grew {before:.0f} -> {after:.0f} MB"
    assert "401 POST /v1/completions from 127.0.0.1" in server.log_tail(500)
    answers_normally(server)


# ---- the API's description needs the key too -------------------------------------------------------------------------
def test_docs_and_schema_need_the_key(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        openai_error(httpx.get(server.url + path), 401)
        openai_error(httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}), 401)
        assert httpx.get(server.url + path, headers=AUTH).status_code == 200, path
    assert httpx.get(server.url + "/health").status_code == 200  # open: load balancers send no key
    openai_error(httpx.get(server.url + "/v1/nothing"), 401)  # no route is found for a client without the key
    openai_error(httpx.get(server.url + "/v1/nothing", headers=AUTH), 404)


# ---- X-Forwarded-For is the client's word, not its address -----------------------------------------------------------
def test_forwarded_for_does_not_change_the_client(server):
    # believed, the header would make this loopback client 203.0.113.5: refused by the local-only admin rule
    body = {"master_address": "127.0.0.1", "master_port": 80, "rank_offset": 1, "world_size": 2}
    for forwarded in ("203.0.113.5", "10.1.2.3, 127.0.0.1"):
        r = httpx.post(server.url + "/init_process_group", json=body, timeout=30,
                       headers={**AUTH, "X-Forwarded-For": forwarded})
        message = openai_error(r, 403)["message"]
        assert "privileged" in message and "local clients only" not in message, message  # the port rule's 403
    assert "403 /init_process_group from 127.0.0.1" in server.log_tail(200)
    answers_normally(server)
