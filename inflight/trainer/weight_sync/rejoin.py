"""The trainer's view of servers that restart during a run (`pipeline.restart_servers`): which are up, which
refuse connections, which weights each serves, and forming the weight-update group again once all are back."""

from __future__ import annotations

import time
from typing import Any

import httpx


def reachable(url: str, api_key: str = "", timeout_s: float = 2.0) -> bool:
    """The server process answers HTTP (a gated server's 503 counts: it is up, only not yet serving)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        return httpx.get(url + "/health", timeout=timeout_s, headers=headers).status_code in (200, 503)
    except httpx.HTTPError:
        return False


def refused(url: str) -> bool:
    """The server's port refuses connections: its process is gone (a slow answer is not counted)."""
    try:
        httpx.get(url + "/health", timeout=2.0)
        return False
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False


def server_versions(urls: list[str], api_key: str = "") -> dict[str, Any]:
    """{url: version of its weights, or 'down' / 'waiting for weights'} (for error messages and tests)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out: dict[str, Any] = {}
    for url in urls:
        try:
            r = httpx.get(url + "/health", timeout=2.0, headers=headers)
            out[url] = r.json().get("version") if r.status_code == 200 else "waiting for weights"
        except (httpx.HTTPError, ValueError):
            out[url] = "down"
    return out


def rejoin_weight_group(sync: Any, timeout_s: float, api_key: str = "") -> None:
    """Wait until every server answers, then form the weight-update group again on a fresh port (the old store's
    port is still held; servers that were in the old group replace it with the new one)."""
    deadline = time.monotonic() + timeout_s
    while not all(reachable(u, api_key) for u in sync.urls):
        if time.monotonic() > deadline:
            raise TimeoutError(f"servers not back after {timeout_s:.0f} s: {server_versions(sync.urls, api_key)}")
        time.sleep(0.5)
    if getattr(sync, "transport", None) == "file":  # only the built-in protocol has a file transport
        return
    sync.drop_group()  # shut down and freed off this thread: a broadcast still in flight on it never blocks here
    sync.master_port = 0
    sync.init_process_group()
