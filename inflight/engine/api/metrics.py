"""The Prometheus metrics of one inflight server (GET /metrics, routes_health.py), through prometheus_client, in a
registry of the app's own (never the process-wide one: several apps may live in one process).

Read from the engine when scraped (`EngineCollector`): the engine's counters and gauges (`engine.stats()`), the
receiver's weight updates and the admission's 429s, under the names they have always had (docs/inference-contract.md).

Observed as they happen (`ServerMetrics`), as histograms:
    inflight_request_queue_time_seconds         arrival -> first scheduled (the built-in engine's stamp)
    inflight_time_to_first_token_seconds        arrival -> the request's first token
    inflight_time_per_output_token_seconds      per choice: (last token - first token) / (tokens - 1)
    inflight_e2e_request_latency_seconds        arrival -> the request's last choice ended
    inflight_weight_update_pause_seconds        per weight update applied: seconds generation was paused
    inflight_served_token_policy_lag_versions   per token served: versions between the weights that sampled it and
                                                those that ended its choice
The arrival is when the OpenAI route took the request (before its prompt is rendered and tokenized); the requests'
timings are recorded by request.Generation from the engine's events (routes_openai.py wires them to this object)."""

from __future__ import annotations

import bisect
import collections
import threading
from typing import Any, Iterable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from inflight.engine.scheduler.request import Choice, Generation

# (name, type, help, key of engine.stats()); the receiver's updates and the admission's 429s are added below
ENGINE_METRICS = (
    ("inflight_running_requests", "gauge", "sequences being decoded", "running"),
    ("inflight_waiting_requests", "gauge", "sequences waiting for a batch slot", "waiting"),
    ("inflight_generated_tokens_total", "counter", "tokens generated", "generated_tokens_total"),
    ("inflight_batch_occupancy", "gauge", "running / max batch", "batch_occupancy"),
    ("inflight_weight_version", "gauge", "version of the loaded weights", "version"),
    ("inflight_paused_seconds_total", "counter", "seconds generation was paused for weight updates",
     "paused_seconds_total"),
    ("inflight_engine_steps_total", "counter", "engine steps", "steps"),
    ("inflight_prefill_tokens_total", "counter", "prompt tokens run through the model (prefill, re-prefill)",
     "prefill_tokens_total"),
    ("inflight_prefix_reused_tokens_total", "counter", "prompt tokens whose KV was reused from a finished sequence "
     "(not prefilled)", "prefix_reused_tokens_total"),
    ("inflight_retained_sequences", "gauge", "finished sequences whose KV is kept for prefix reuse", "retained"),
)

# Buckets (seconds): RL generations run from milliseconds to minutes, a weight update's pause from a millisecond
# (staged swaps) to tens of seconds (a large model copied in the pause).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
PAUSE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32, 64)


class EngineCollector(Collector):
    """The engine's counters and gauges, read at every scrape. Counters are emitted as `<name>_total` (what
    prometheus_client writes for a counter family), with no `_created` sample: the names scrapers always read."""

    def __init__(self, engine: Any, receiver: Any = None, admission: Any = None):
        self.engine, self.receiver, self.admission = engine, receiver, admission

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        rows = [(name, kind, help_, stats.get(key, 0)) for name, kind, help_, key in ENGINE_METRICS]
        rows.append(("inflight_weight_updates_total", "counter", "weight updates applied",
                     getattr(self.receiver, "updates", 0)))
        rows.append(("inflight_rejected_requests_total", "counter", "requests refused with 429 (queue limit)",
                     getattr(self.admission, "rejected", 0)))
        for name, kind, help_, value in rows:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, help_, value=float(value))


class WeightedHistogram(Collector):
    """A histogram of integer observations that come in batches of equal values (a choice's tokens by versions
    behind): `observe(value, count)` costs the same for 1 or 10,000 tokens, where prometheus_client's Histogram
    takes one `observe` (a microsecond or two) per token."""

    def __init__(self, name: str, documentation: str, buckets: Iterable[int], registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self.bounds = sorted(buckets)
        self._counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        i = bisect.bisect_left(self.bounds, value)  # the first bucket whose bound is >= value
        with self._lock:
            self._counts[i] += count
            self._sum += value * count

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, c in zip([*map(float, self.bounds), float("inf")], counts, strict=True):
            cumulative += c
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=total)


class ServerMetrics:
    """The /metrics of one app: its registry, the engine's figures read when scraped, and the histograms the
    routes observe. `receiver` (its `updates`) and `admission` (its `rejected`) may be None (counted as 0)."""

    def __init__(self, engine: Any, receiver: Any = None, admission: Any = None):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, receiver, admission))
        reg = self.registry
        self.queue_time = Histogram(
            "inflight_request_queue_time_seconds", "seconds from a request's arrival to its first engine step "
            "(held for min_weight_version included; built-in engine only)", buckets=LATENCY_BUCKETS, registry=reg)
        self.ttft = Histogram(
            "inflight_time_to_first_token_seconds", "seconds from a request's arrival to its first generated token",
            buckets=LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram(
            "inflight_time_per_output_token_seconds", "per choice of two tokens or more: seconds from its first to "
            "its last token / (tokens - 1)", buckets=PER_TOKEN_BUCKETS, registry=reg)
        self.e2e = Histogram(
            "inflight_e2e_request_latency_seconds", "seconds from a request's arrival to the end of its last choice "
            "(requests answered in full)", buckets=LATENCY_BUCKETS, registry=reg)
        self.pause = Histogram(
            "inflight_weight_update_pause_seconds", "seconds generation was paused, per weight update applied",
            buckets=PAUSE_BUCKETS, registry=reg)
        self.lag = WeightedHistogram(
            "inflight_served_token_policy_lag_versions", "per token served: weight versions between the weights "
            "that sampled it and the weights that ended its choice (0: on-policy)", LAG_BUCKETS, reg)

    def text(self) -> str:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry).decode()

    # ---- request.GenerationMetrics: called by request.Generation as its events come --------------------------------
    def scheduled(self, gen: Generation) -> None:
        if gen.scheduled is not None:
            self.queue_time.observe(max(0.0, gen.scheduled - gen.arrival))

    def first_token(self, gen: Generation) -> None:
        if gen.first_token is not None:
            self.ttft.observe(max(0.0, gen.first_token - gen.arrival))

    def finished(self, gen: Generation) -> None:
        if gen.ended is not None:
            self.e2e.observe(max(0.0, gen.ended - gen.arrival))
        for ch in gen.choices:
            self._served(ch)

    def _served(self, ch: Choice) -> None:
        n = len(ch.token_ids)
        if n >= 2:
            self.tpot.observe(max(0.0, ch.last_token - ch.first_token) / (n - 1))
        for version, count in collections.Counter(ch.versions).items():  # counted in C: one entry per version
            # a trainer's new run may take the version back (docs/inference-contract.md): counted as on-policy
            self.lag.observe(max(0, ch.final_version - version), count)

    # ---- weight updates -------------------------------------------------------------------------------------------
    def weight_update(self, pause_s: float) -> None:
        self.pause.observe(max(0.0, pause_s))
