"""What the connector counts, in the payload vLLM carries between its processes.

vLLM asks each connector for its stats after every engine step (the scheduler
side in the engine process, the worker side in each worker) and hands the
merged payload to its stat loggers in the API server process (``metrics``).
The payload is plain JSON-like data::

    {"counts":  {"lookups": 3, "restore_failures|damaged": 1, "store_read_bytes|file": 4096, ...},
     "samples": {"restore_decode_seconds": [0.08, ...], ...},
     "gauges":  {"store_entries|file": 12, ...}}

where ``name|label`` carries the one label a series has (a cause or a tier):
counts add up, samples concatenate, the latest gauge wins. ``METRICS`` defines
every series once: name, type, help and label. This module needs neither vLLM
nor torch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from kvtool.store import Store
from kvtool.store.metrics import tier_samples

SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FAILURE_CAUSES = ("missing", "damaged", "mismatch", "store_error", "decode_error", "internal")


@dataclass(frozen=True)
class Metric:
    name: str  # in the payload; Prometheus name: "kvtool_" + name (+ "_total" for counters)
    kind: str  # "counter", "histogram" or "gauge"
    help: str
    label: str | None = None


METRICS = {m.name: m for m in (
    Metric("lookups", "counter", "Prompts looked up in the kvtool store (a request vLLM could not schedule at once "
                                 "is looked up again)."),
    Metric("lookup_hits", "counter", "Lookups that found at least one entry to restore."),
    Metric("tokens_found", "counter", "Prompt tokens found in the store beyond vLLM's own prefix cache (claimed)."),
    Metric("tokens_restored", "counter", "Prompt tokens restored into vLLM's KV cache."),
    Metric("entries_restored", "counter", "Store entries restored."),
    Metric("restore_failures", "counter", "Entries that could not be restored (vLLM recomputed them), by cause.",
           "cause"),
    Metric("tokens_failed", "counter", "Claimed tokens that failed to restore and were recomputed."),
    Metric("entries_saved", "counter", "Entries compressed and put into the store."),
    Metric("save_failures", "counter", "Entries the store refused or that failed to encode."),
    Metric("saved_raw_bytes", "counter", "Uncompressed KV bytes of the entries saved."),
    Metric("saved_bytes", "counter", "Compressed bytes of the entries saved."),
    Metric("store_read_bytes", "counter", "Bytes read from each store tier.", "tier"),
    Metric("store_written_bytes", "counter", "Bytes written to each store tier.", "tier"),
    Metric("store_evictions", "counter", "Entries each store tier removed to stay within capacity.", "tier"),
    Metric("store_put_refused", "counter", "Writes each store tier's server refused for lack of memory, even after "
                                           "room was made (Redis OOM).", "tier"),
    Metric("restore_seconds", "histogram", "Restore of one engine step: fetch, decode and copy, wall time."),
    Metric("restore_fetch_seconds", "histogram", "Reading a step's entries from the store."),
    Metric("restore_decode_seconds", "histogram", "Decompressing a step's entries."),
    Metric("restore_copy_seconds", "histogram", "Copying a step's decoded KV into vLLM's paged blocks."),
    Metric("save_seconds", "histogram", "Compressing and storing one entry."),
    Metric("compression_ratio", "gauge", "Uncompressed per stored bytes of the entries this server saved."),
    Metric("store_entries", "gauge", "Entries each store tier holds (as seen by worker rank 0).", "tier"),
    Metric("store_used_bytes", "gauge", "Bytes each store tier holds (as seen by worker rank 0).", "tier"),
    Metric("store_capacity_bytes", "gauge", "Capacity of each bounded store tier.", "tier"),
    Metric("write_behind_queued", "gauge", "Entries waiting for their copy in a persistent tier."),
)}
# store.stats() keys -> the payload's per-tier counters and gauges
_TIER_COUNTERS = {"bytes_read": "store_read_bytes", "bytes_stored": "store_written_bytes", "evictions": "store_evictions",
                  "put_refused": "store_put_refused"}
_TIER_GAUGES = {"entries": "store_entries", "used_bytes": "store_used_bytes", "capacity_bytes": "store_capacity_bytes"}


def _key(name: str, label: str | None = None) -> str:
    return name if label is None else f"{name}|{label}"


class StatsCollector:
    """What one connector counted since vLLM last asked; thread-safe (saves finish on another thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty()
        self._tier_totals: dict[str, float] = {}

    def count(self, name: str, n: float = 1, label: str | None = None) -> None:
        if n:
            with self._lock:
                counts = self._data["counts"]
                counts[_key(name, label)] = counts.get(_key(name, label), 0) + n

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            self._data["samples"].setdefault(name, []).append(seconds)

    def gauge(self, name: str, value: float, label: str | None = None) -> None:
        with self._lock:
            self._data["gauges"][_key(name, label)] = value

    def sample_store(self, store: Store) -> None:
        """Per-tier bytes read and written since the last call, and what each tier holds now."""
        stats = store.stats()
        for metric, tier, value in tier_samples(stats):
            if metric.stat in _TIER_COUNTERS:
                key = _key(_TIER_COUNTERS[metric.stat], tier)
                with self._lock:
                    previous, self._tier_totals[key] = self._tier_totals.get(key, 0), value
                self.count(_TIER_COUNTERS[metric.stat], value - previous, tier)
            elif metric.stat in _TIER_GAUGES:
                self.gauge(_TIER_GAUGES[metric.stat], value, tier)
        behind = stats.get("write_behind")
        if behind is not None:
            self.gauge("write_behind_queued", behind["queued"])

    def take(self) -> dict[str, dict[str, Any]] | None:
        """The stats since the last call (None if nothing happened), and start counting afresh."""
        with self._lock:
            data, self._data = self._data, empty()
        return None if is_empty(data) else data


def empty() -> dict[str, dict[str, Any]]:
    return {"counts": {}, "samples": {}, "gauges": {}}


def is_empty(data: dict[str, Any]) -> bool:
    return not any(data.get(part) for part in ("counts", "samples", "gauges"))


def merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Add ``other``'s payload to ``into`` (changed in place) and return it."""
    counts, samples, gauges = into["counts"], into["samples"], into["gauges"]
    for key, n in other.get("counts", {}).items():
        counts[key] = counts.get(key, 0) + n
    for name, values in other.get("samples", {}).items():
        samples.setdefault(name, []).extend(values)
    gauges.update(other.get("gauges", {}))
    return into


def summary(data: dict[str, Any]) -> dict[str, int | float]:
    """One interval's numbers for a log line: counts, mean milliseconds per step of each phase, saved sizes."""
    counts = data.get("counts", {})
    out: dict[str, int | float] = {
        name: counts.get(name, 0) for name in ("lookups", "lookup_hits", "tokens_found", "tokens_restored")
    }
    out["restore_failures"] = sum(n for key, n in counts.items() if key.startswith("restore_failures|"))
    for name, short in (("restore_fetch_seconds", "fetch"), ("restore_decode_seconds", "decode"),
                        ("restore_copy_seconds", "copy")):
        values = data.get("samples", {}).get(name, [])
        out[f"{short}_ms_per_step"] = round(1e3 * sum(values) / len(values), 1) if values else 0.0
    out["entries_saved"] = counts.get("entries_saved", 0)
    out["saved_MB"] = round(counts.get("saved_bytes", 0) / 1e6, 2)
    if counts.get("saved_bytes"):
        out["compression_ratio"] = round(counts["saved_raw_bytes"] / counts["saved_bytes"], 3)
    return out
