"""Prometheus metrics: the store's counters read at scrape time, and the API's own requests.

Each app has its own registry, so several servers in one process (tests, an
embedded server beside a CLI one) never share or clash over metrics.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtool.server.guards import App, Message, Receive, Scope, Send
from kvtool.store import TieredStore

_TIER_COUNTERS = ("hits", "misses", "puts", "put_failures", "put_refused", "deletes", "evictions", "corrupt", "errors",
                  "bytes_stored", "bytes_read")


class StoreCollector:
    """Per-tier gauges and counters from ``TieredStore.stats()``, and the API's live state."""

    def __init__(self, store: TieredStore, api_gauges: Callable[[], dict[str, float]]) -> None:
        self.store = store
        self.api_gauges = api_gauges

    def collect(self) -> Iterator[Metric]:
        stats = self.store.stats()
        entries = GaugeMetricFamily("kvtool_store_entries", "Entries held, per tier", labels=["tier"])
        used = GaugeMetricFamily("kvtool_store_used_bytes", "Bytes held, per tier", labels=["tier"])
        capacity = GaugeMetricFamily("kvtool_store_capacity_bytes", "Capacity, per bounded tier", labels=["tier"])
        counters = {name: CounterMetricFamily(f"kvtool_store_{name}", f"Store {name.replace('_', ' ')}, per tier",
                                              labels=["tier"]) for name in _TIER_COUNTERS}
        for tier in stats["tiers"]:
            name = tier["tier"]
            entries.add_metric([name], tier["entries"])
            if tier["used_bytes"] is not None:
                used.add_metric([name], tier["used_bytes"])
            if tier["capacity_bytes"] is not None:
                capacity.add_metric([name], tier["capacity_bytes"])
            for counter, family in counters.items():
                family.add_metric([name], tier[counter])
        events = CounterMetricFamily("kvtool_store_events", "Moves between tiers, by kind", labels=["kind"])
        for kind, count in stats["events"].items():
            events.add_metric([kind], count)
        yield from (entries, used, capacity, *counters.values(), events)
        yield GaugeMetricFamily("kvtool_store_pinned_entries", "Entries pinned", value=stats["pinned"])
        for name, value in self.api_gauges().items():
            yield GaugeMetricFamily(f"kvtool_api_{name}", f"API {name.replace('_', ' ')}", value=value)


class ApiMetrics:
    """The registry of one app, and the ASGI wrapper that counts its requests."""

    def __init__(self, store: TieredStore, api_gauges: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(StoreCollector(store, api_gauges))
        self.requests = Counter("kvtool_api_requests", "API requests by route and status",
                                ["method", "route", "status"], registry=self.registry)
        self.seconds = Histogram("kvtool_api_request_seconds", "API request time until the response starts, by route",
                                 ["route"], registry=self.registry)
        self.refused = Counter("kvtool_api_refused", "Requests refused before any endpoint ran, by reason",
                               ["reason"], registry=self.registry)

    def wrap(self, app: App) -> App:
        async def counted(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                return await app(scope, receive, send)
            start = time.perf_counter()
            status = 500

            async def send_and_note(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                    route = _route(scope)
                    self.seconds.labels(route).observe(time.perf_counter() - start)
                await send(message)

            try:
                await app(scope, receive, send_and_note)
            finally:
                self.requests.labels(scope["method"], _route(scope), str(status)).inc()

        return counted


def _route(scope: Scope) -> str:
    """The route's path template (bounded label values), or ``other``."""
    route = scope.get("route")
    return getattr(route, "path", "other")
