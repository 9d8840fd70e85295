"""The launcher reads every server's Prometheus-text /metrics periodically and logs rates from the counters:
generated tokens/s, share of time paused for weight updates, batch occupancy, weight version."""

from __future__ import annotations

import time
from typing import Any

import httpx


def parse_prometheus(text: str) -> dict[str, float]:
    """`name value` and `name{labels} value` lines -> {name: value} (labels dropped, last one wins)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) < 2:
            continue
        name = parts[0].split("{", 1)[0]
        try:
            out[name] = float(parts[1])
        except ValueError:
            continue
    return out


class ServerScraper:
    def __init__(self, urls: list[str], log: Any, api_key: str = "", timeout_s: float = 2.0):
        self.urls = urls
        self.log = log
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=timeout_s, headers=headers)
        self._last: dict[int, tuple[float, dict[str, float]]] = {}

    def scrape(self) -> list[dict[str, Any]]:
        out = []
        for k, url in enumerate(self.urls):
            try:
                r = self.http.get(url + "/metrics")
                r.raise_for_status()
            except httpx.HTTPError:
                continue  # a server that stops answering is the launcher's process watch's business
            now, m = time.time(), parse_prometheus(r.text)
            rec: dict[str, Any] = {
                "server": k,
                "running": m.get("inflight_running_requests"),
                "waiting": m.get("inflight_waiting_requests"),
                "batch_occupancy": m.get("inflight_batch_occupancy"),
                "weight_version": m.get("inflight_weight_version"),
                "generated_tokens_total": m.get("inflight_generated_tokens_total"),
                "paused_seconds_total": m.get("inflight_paused_seconds_total"),
                "weight_updates_total": m.get("inflight_weight_updates_total"),
                # the built-in engine's: steps run and prompt tokens prefilled (what a run's server really did,
                # beside what bench/plan_check.py's simulator charges it)
                "engine_steps_total": m.get("inflight_engine_steps_total"),
                "prefill_tokens_total": m.get("inflight_prefill_tokens_total"),
            }
            if k in self._last:
                t_prev, prev = self._last[k]
                dt = max(now - t_prev, 1e-9)
                for key, rate in (("inflight_generated_tokens_total", "tokens_per_s"),
                                  ("inflight_paused_seconds_total", "paused_share")):
                    if key in m and key in prev:
                        rec[rate] = (m[key] - prev[key]) / dt
            self._last[k] = (now, m)
            self.log.log("server_metrics", **rec)
            out.append(rec)
        return out

    def close(self) -> None:
        self.http.close()
