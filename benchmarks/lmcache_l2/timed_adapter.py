"""Any LMCache L2 adapter, unchanged, with its load tasks timed and, if asked, a byte budget LMCache enforces.

The cells of ``bench.py`` give LMCache this plugin instead of the adapter itself::

    {"type": "plugin", "module_path": "benchmarks.lmcache_l2.timed_adapter", "class_name": "TimedL2Adapter",
     "adapter_params": {"inner": {"type": "fs", "base_path": "/tmp/l2"}, "timings": "/tmp/loads.jsonl",
                        "capacity_bytes": 100000000},
     "eviction": {"eviction_policy": "LRU", "trigger_watermark": 1.0, "eviction_ratio": 0.1}}

The inner adapter is built by LMCache's own factory from its own spec, and every call
passes through to it. A load task is timed from ``submit_load_task`` to the first
``query_load_result`` that returns its bitmap (LMCache's prefetch loop polls the load
event fd, so that is when LMCache has the chunks): one JSON line per task with its
seconds, the keys asked for and the keys loaded. LMCache submits one load task per
adapter for each request it prefetches, so a line is one request's L2 load.

``capacity_bytes`` declares a capacity on the inner adapter, which neither ``fs`` nor
kvtool's adapter declares by itself, so that LMCache's own L2 eviction controller (the
``eviction`` block of the spec) holds both to the same budget with the same policy. The
bytes counted are those the adapter reports to LMCache: raw bytes for ``fs``, stored
(compressed) bytes for kvtool's adapter.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config


def build_inner(spec: dict[str, Any], l1_memory_desc: Any = None) -> L2AdapterInterface:
    """An adapter made as ``lmcache server --l2-adapter SPEC`` makes it."""
    config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)])).adapters[0]
    return create_l2_adapter(config, l1_memory_desc)


class TimedL2Adapter(L2AdapterInterface):
    """See the module docstring."""

    def __init__(self, params: dict[str, Any], l1_memory_desc: Any = None) -> None:
        super().__init__()
        self.inner = build_inner(params["inner"], l1_memory_desc)
        capacity = int(params.get("capacity_bytes", 0))
        if capacity > 0:
            self.inner._max_capacity_bytes = capacity  # what LMCache's eviction controller reads
        self._timings = open(Path(params["timings"]), "a", buffering=1)
        self._lock = threading.Lock()
        self._loads: dict[int, tuple[float, int]] = {}

    # -- what is timed ------------------------------------------------------------------------
    def submit_load_task(self, keys: list, objects: list) -> Any:
        start = time.perf_counter()
        task = self.inner.submit_load_task(keys, objects)
        with self._lock:
            self._loads[task] = (start, len(keys))
        return task

    def query_load_result(self, task_id: Any) -> Any:
        bitmap = self.inner.query_load_result(task_id)
        if bitmap is not None:
            with self._lock:
                start, asked = self._loads.pop(task_id, (None, 0))
                if start is not None:
                    line = {"seconds": time.perf_counter() - start, "keys": asked,
                            "loaded": len(bitmap.get_indices_list()), "at": time.time()}
                    self._timings.write(json.dumps(line) + "\n")
        return bitmap

    # -- the rest passes through --------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self.inner.get_store_event_fd()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self.inner.get_lookup_and_lock_event_fd()

    def get_load_event_fd(self) -> int:
        return self.inner.get_load_event_fd()

    def submit_store_task(self, keys: list, objects: list) -> Any:
        return self.inner.submit_store_task(keys, objects)

    def pop_completed_store_tasks(self) -> dict:
        return self.inner.pop_completed_store_tasks()

    def submit_lookup_and_lock_task(self, keys: list, group_layout_descs: dict) -> Any:
        return self.inner.submit_lookup_and_lock_task(keys, group_layout_descs)

    def query_lookup_and_lock_result(self, task_id: Any) -> Any:
        return self.inner.query_lookup_and_lock_result(task_id)

    def submit_unlock(self, keys: list) -> None:
        self.inner.submit_unlock(keys)

    def register_listener(self, listener: Any) -> None:
        self.inner.register_listener(listener)

    def set_backend_identity(self, name: str, shared: bool = False) -> None:
        self.inner.set_backend_identity(name, shared)

    @property
    def supports_global_eviction(self) -> bool:
        return self.inner.supports_global_eviction

    def delete(self, keys: list) -> None:
        self.inner.delete(keys)

    def get_usage(self) -> Any:
        return self.inner.get_usage()

    def report_status(self) -> dict:
        return self.inner.report_status()

    def close(self) -> None:
        self.inner.close()
        self._timings.close()
