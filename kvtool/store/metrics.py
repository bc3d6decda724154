"""What a store counts, and the same numbers as Prometheus metrics.

``StoreMetrics`` keeps one process's counters for one store (hits, misses,
bytes read and written, evictions, damaged entries) and its recent get
latencies. ``TIER_METRICS`` names each number once for Prometheus, so the
standalone exporter (``kvtool store stats --prometheus``) and the vLLM
connector's ``/metrics`` publish the same series under the same names.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

LATENCY_WINDOW = 4096  # the most recent gets the percentiles are computed over
# Upper bounds (seconds) of the get-latency histogram: a memory hit to a slow remote read.
LATENCY_BUCKETS = (1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)

COUNTERS = (
    "hits", "misses", "puts", "put_failures", "put_refused", "deletes", "evictions", "corrupt", "errors",
    "bytes_raw", "bytes_stored", "bytes_read",
)


class StoreMetrics:
    """Thread-safe hit/miss/byte counters, a get-latency histogram and a window of recent latencies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one is +Inf
        self._latency_sum = 0.0

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def hit(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._counts["hits"] += 1
            self._counts["bytes_read"] += nbytes
            self._observe(seconds)

    def miss(self, seconds: float) -> None:
        with self._lock:
            self._counts["misses"] += 1
            self._observe(seconds)

    def stored(self, raw_bytes: int, stored_bytes: int) -> None:
        with self._lock:
            self._counts["puts"] += 1
            self._counts["bytes_raw"] += raw_bytes
            self._counts["bytes_stored"] += stored_bytes

    def _observe(self, seconds: float) -> None:
        self._latencies.append(seconds)
        self._buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self._latency_sum += seconds

    def snapshot(self) -> dict[str, Any]:
        """Counters, ``hit_rate``, ``get_p50_ms``/``get_p99_ms`` (None before the first get),
        ``get_seconds`` (the latency histogram: per-bucket counts, the last bucket unbounded) and
        ``compression_ratio`` of what was written (None before the first put)."""
        with self._lock:
            data: dict[str, Any] = dict(self._counts)
            latencies = sorted(self._latencies)
            histogram = {"le": list(LATENCY_BUCKETS), "counts": list(self._buckets), "sum": self._latency_sum}
        lookups = data["hits"] + data["misses"]
        data["hit_rate"] = data["hits"] / lookups if lookups else None
        data["get_p50_ms"] = _percentile(latencies, 0.50)
        data["get_p99_ms"] = _percentile(latencies, 0.99)
        data["get_seconds"] = histogram
        data["compression_ratio"] = data["bytes_raw"] / data["bytes_stored"] if data["bytes_stored"] else None
        return data


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))
    return sorted_values[index] * 1000.0


# --- the same numbers for Prometheus -------------------------------------------


@dataclass(frozen=True)
class MetricDef:
    """One Prometheus series per tier: its name (without ``_total``), type, help, and ``stats()`` key."""

    name: str
    kind: str  # "counter" or "gauge"
    stat: str
    help: str


TIER_METRICS = (
    MetricDef("kvtool_store_hits", "counter", "hits", "Reads that found a valid entry."),
    MetricDef("kvtool_store_misses", "counter", "misses", "Reads that found no entry, or a damaged one."),
    MetricDef("kvtool_store_puts", "counter", "puts", "Entries written."),
    MetricDef("kvtool_store_put_failures", "counter", "put_failures", "Writes refused or failed."),
    MetricDef("kvtool_store_put_refused", "counter", "put_refused",
              "Writes the server refused for lack of memory even after room was made (part of put_failures)."),
    MetricDef("kvtool_store_server_refused_writes", "gauge", "server_refused_writes",
              "Writes the tier's servers refused for lack of memory, from every client (Redis's errorstat_OOM)."),
    MetricDef("kvtool_store_server_evicted_keys", "gauge", "server_evicted_keys",
              "Keys the tier's servers evicted by their own maxmemory policy, every client's."),
    MetricDef("kvtool_store_deletes", "counter", "deletes", "Entries deleted, or moved out to another tier."),
    MetricDef("kvtool_store_evictions", "counter", "evictions", "Entries removed to stay within capacity."),
    MetricDef("kvtool_store_corrupt", "counter", "corrupt", "Damaged entries found and dropped."),
    MetricDef("kvtool_store_errors", "counter", "errors", "I/O or connection failures."),
    MetricDef("kvtool_store_read_bytes", "counter", "bytes_read", "Bytes of entries read (hits)."),
    MetricDef("kvtool_store_written_bytes", "counter", "bytes_stored", "Bytes of entries written, as stored."),
    MetricDef("kvtool_store_written_raw_bytes", "counter", "bytes_raw", "Uncompressed bytes of the KV cache written."),
    MetricDef("kvtool_store_entries", "gauge", "entries", "Entries the tier holds."),
    MetricDef("kvtool_store_used_bytes", "gauge", "used_bytes", "Bytes the tier's entries occupy."),
    MetricDef("kvtool_store_capacity_bytes", "gauge", "capacity_bytes", "The tier's capacity (absent: unbounded)."),
    MetricDef("kvtool_store_compression_ratio", "gauge", "compression_ratio",
              "Uncompressed KV bytes per stored byte, of the entries held (file) or written (other tiers)."),
)
GET_SECONDS = MetricDef("kvtool_store_get_seconds", "histogram", "get_seconds", "Latency of reads from the tier.")


def tiers_of(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-tier stats of a tiered store's ``stats()``, or a single store's own, each with ``tier``."""
    return stats.get("tiers") or [{**stats, "tier": stats["name"]}]


def tier_samples(stats: dict[str, Any]) -> Iterator[tuple[MetricDef, str, float]]:
    """``(metric, tier, value)`` for each number a store's ``stats()`` reports (unknown ones skipped)."""
    for tier in tiers_of(stats):
        for metric in TIER_METRICS:
            value = tier.get(metric.stat)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield metric, tier["tier"], value


def prometheus_text(stats: dict[str, Any]) -> bytes:
    """A store's ``stats()`` in Prometheus's text exposition format, one label ``tier``."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    class _Collector:
        def collect(self) -> Iterator[Any]:
            families: dict[str, Any] = {}
            for metric, tier, value in tier_samples(stats):
                family = families.get(metric.name)
                if family is None:
                    kind = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
                    family = families[metric.name] = kind(metric.name, metric.help, labels=["tier"])
                family.add_metric([tier], value)
            yield from families.values()
            histogram = HistogramMetricFamily(GET_SECONDS.name, GET_SECONDS.help, labels=["tier"])
            for tier_stats in tiers_of(stats):
                h = tier_stats.get(GET_SECONDS.stat)
                if h:
                    histogram.add_metric([tier_stats["tier"]], _cumulative(h), h["sum"])
            yield histogram

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry)


def _cumulative(histogram: dict[str, Any]) -> list[tuple[str, float]]:
    bounds = [repr(float(b)) for b in histogram["le"]] + ["+Inf"]
    total, buckets = 0, []
    for bound, count in zip(bounds, histogram["counts"]):
        total += count
        buckets.append((bound, total))
    return buckets
