"""kvtool's numbers in vLLM's own channels: the periodic log line and ``/metrics``.

``KvtoolConnectorStats`` wraps the connector's payload (``stats``) in vLLM's
``KVConnectorStats``: vLLM merges the scheduler's and the workers' payloads
each step and, in the API server process, turns them into its
``KV Transfer metrics: ...`` log line (INFO, once per log interval, beside the
server's throughput line) through ``reduce``, and into Prometheus series on
``/metrics`` through ``KvtoolPromMetrics``: every series of ``stats.METRICS``
as ``kvtool_<name>``, with vLLM's own per-engine labels.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvtool.integrations.vllm.stats import FAILURE_CAUSES, METRICS, SECONDS_BUCKETS, empty, is_empty, merge, summary

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass
class KvtoolConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    @classmethod
    def from_payload(cls, data: dict[str, Any] | None) -> "KvtoolConnectorStats":
        """Stats from a payload vLLM passes around (copied: vLLM's stat loggers share the dict)."""
        return cls(copy.deepcopy(data) if data else {})

    def reset(self) -> None:
        self.data = empty()

    def aggregate(self, other: KVConnectorStats) -> "KvtoolConnectorStats":
        merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return summary(self.data)

    def is_empty(self) -> bool:
        return is_empty(self.data)


class KvtoolPromMetrics(KVConnectorPromMetrics):
    """Every series of ``METRICS`` as ``kvtool_*``, with vLLM's per-engine labels (model, engine)."""

    def __init__(self, vllm_config: "VllmConfig", metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for metric in METRICS.values():
            options: dict[str, Any] = {
                "name": f"kvtool_{metric.name}",
                "documentation": metric.help,
                "labelnames": labelnames + ([metric.label] if metric.label else []),
            }
            if metric.kind == "counter":
                self._metrics[metric.name] = self._counter_cls(**options)
            elif metric.kind == "histogram":
                self._metrics[metric.name] = self._histogram_cls(**options, buckets=list(SECONDS_BUCKETS))
            else:
                self._metrics[metric.name] = self._gauge_cls(**options, multiprocess_mode="mostrecent")
        self._saved: dict[int, list[float]] = {}  # per engine: raw and stored bytes saved so far
        for engine in per_engine_labelvalues:  # counters start at 0, so rates work from the first sample
            for metric in METRICS.values():
                if metric.kind == "counter" and metric.label is None:
                    self._series(metric.name, engine)
            for cause in FAILURE_CAUSES:
                self._series("restore_failures", engine, cause)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        counts = transfer_stats_data.get("counts", {})
        for key, n in counts.items():
            name, _, label = key.partition("|")
            if name in METRICS:
                self._series(name, engine_idx, label or None).inc(n)
        for name, values in transfer_stats_data.get("samples", {}).items():
            if name in METRICS:
                series = self._series(name, engine_idx)
                for value in values:
                    series.observe(value)
        for key, value in transfer_stats_data.get("gauges", {}).items():
            name, _, label = key.partition("|")
            if name in METRICS:
                self._series(name, engine_idx, label or None).set(value)
        saved = self._saved.setdefault(engine_idx, [0, 0])
        saved[0] += counts.get("saved_raw_bytes", 0)
        saved[1] += counts.get("saved_bytes", 0)
        if saved[1]:
            self._series("compression_ratio", engine_idx).set(saved[0] / saved[1])

    def _series(self, name: str, engine_idx: int, label: str | None = None) -> Any:
        values = list(self.per_engine_labelvalues[engine_idx]) + ([label] if label is not None else [])
        return self._metrics[name].labels(*values)
