"""Counters and latency percentiles a store reports through ``stats()``."""

from __future__ import annotations

import threading
from collections import deque

LATENCY_WINDOW = 4096  # the most recent gets the percentiles are computed over


class StoreMetrics:
    """Thread-safe hit/miss/byte counters and a window of recent get latencies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("hits", "misses", "puts", "put_failures", "deletes", "evictions", "corrupt", "errors",
             "bytes_raw", "bytes_stored", "bytes_read"),
            0,
        )
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def hit(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._counts["hits"] += 1
            self._counts["bytes_read"] += nbytes
            self._latencies.append(seconds)

    def miss(self, seconds: float) -> None:
        with self._lock:
            self._counts["misses"] += 1
            self._latencies.append(seconds)

    def stored(self, raw_bytes: int, stored_bytes: int) -> None:
        with self._lock:
            self._counts["puts"] += 1
            self._counts["bytes_raw"] += raw_bytes
            self._counts["bytes_stored"] += stored_bytes

    def snapshot(self) -> dict:
        """Counters plus ``get_p50_ms``/``get_p99_ms`` (None before the first get)."""
        with self._lock:
            data: dict = dict(self._counts)
            latencies = sorted(self._latencies)
        lookups = data["hits"] + data["misses"]
        data["hit_rate"] = data["hits"] / lookups if lookups else None
        data["get_p50_ms"] = _percentile(latencies, 0.50)
        data["get_p99_ms"] = _percentile(latencies, 0.99)
        return data


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))
    return sorted_values[index] * 1000.0
