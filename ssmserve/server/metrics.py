"""Prometheus metrics of one server, in a registry of its own (several apps can coexist)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "ssmserve:"

# (metric name, help, key in LLMEngine.stats())
_GAUGES = [
    ("num_requests_running", "Requests being computed (holding a state slot).", "num_running"),
    ("num_requests_waiting", "Requests queued for their first schedule.", "num_waiting"),
    ("kv_blocks_used", "KV-cache blocks in use.", "kv_blocks_used"),
    ("kv_blocks_total", "KV-cache blocks in the pool.", "kv_blocks_total"),
    ("state_slots_used", "SSM state slots in use.", "state_slots_used"),
    ("state_slots_total", "SSM state slots in the pool.", "state_slots_total"),
]
_COUNTERS = [
    ("prompt_tokens", "Prompt tokens accepted.", "prompt_tokens_total"),
    ("generation_tokens", "Tokens generated.", "generation_tokens_total"),
    ("num_preemptions", "Requests preempted for lack of cache.", "num_preemptions"),
]

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class _EngineStatsCollector(Collector):
    """Reads the engine's counters at scrape time, so they never drift from the engine."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, doc, key in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc, value=stats.get(key, 0))
        for name, doc, key in _COUNTERS:
            yield CounterMetricFamily(PREFIX + name, doc, value=stats.get(key, 0))


class ServerMetrics:
    """Engine gauges and counters plus per-request latency histograms."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(stats))
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Seconds from arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Seconds between two consecutive generated tokens of a request.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests_finished = Counter(
            PREFIX + "request_success",
            "Requests finished, by finish reason.",
            ["finished_reason"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
