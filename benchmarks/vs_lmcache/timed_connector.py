"""kvtool's vLLM connector with a stopwatch: where its time and CPU go, written to a JSON file.

The head-to-head benchmark loads this instead of ``KvtoolConnector``::

    "kv_connector": "TimedKvtoolConnector",
    "kv_connector_module_path": "benchmarks.vs_lmcache.timed_connector"

with ``KVTOOL_BENCH_STATS=/path/stats.json`` in vLLM's environment. The connector
itself is unchanged: the subclass times vLLM's calls into it, and wraps the few
functions the restore and save paths are made of, so that each phase reports its
wall time and the CPU time of the thread that ran it (``time.thread_time``):

- ``lookup``: ``get_num_new_matched_tokens`` (scheduler side, store ``contains``);
- ``fetch``: the store's raw read of an entry's record;
- ``open``: ``entries.open_entry``: the fetch, the record's checks and the .kvz's header and index;
- ``decode``: ``Opened.restore``: the entry's chunks decoded into the paged blocks (all layers at once
  before the forward pass, or one layer at a time beside it), checksums verified, copy included;
- ``restore``: the whole of ``start_load_kv`` (all the above for a step, plus bookkeeping);
- ``capture``: ``save_kv_layer`` (``gather_blocks`` of finished prompt blocks);
- ``encode``: ``entries.put_cache`` on the save thread (coding, the record and the store's ``put``).

The totals and the store's own statistics (entries, bytes held) are rewritten
to the file after every restore and every save, so a reader diffs two reads.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from kvtool import entries
from kvtool.integrations.vllm import transfer
from kvtool.integrations.vllm.connector import KvtoolConnector

_lock = threading.Lock()
_totals: dict[str, dict[str, float]] = {}
_path = Path(os.environ["KVTOOL_BENCH_STATS"]) if os.environ.get("KVTOOL_BENCH_STATS") else None
_store = None  # the connector's store, for its statistics

# vLLM configures no handler for kvtool's logger; its per-request restore lines go to vLLM's log.
_handler = logging.StreamHandler()
_handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
logging.getLogger("kvtool").addHandler(_handler)
logging.getLogger("kvtool").setLevel(logging.INFO)


def _add(phase: str, wall: float, cpu: float, count: int = 1) -> None:
    with _lock:
        t = _totals.setdefault(phase, {"calls": 0, "wall_s": 0.0, "cpu_s": 0.0})
        t["calls"] += count
        t["wall_s"] += wall
        t["cpu_s"] += cpu


def _timed(phase: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _add(phase, time.perf_counter() - wall, time.thread_time() - cpu)

    return wrapper


def _dump() -> None:
    if _path is None:
        return
    with _lock:
        snapshot = {"phases": {k: dict(v) for k, v in _totals.items()}}
    if _store is not None:
        try:
            stats = _store.stats()
            snapshot["store"] = {k: stats.get(k) for k in ("entries", "used_bytes", "capacity_bytes", "hits", "misses")}
        except Exception as exc:  # a closed store at shutdown
            snapshot["store_error"] = str(exc)
    tmp = _path.with_suffix(".tmp")
    tmp.write_text(json.dumps(snapshot))
    os.replace(tmp, _path)


# The functions the transfer module calls, timed where it looks them up.
transfer.gather_blocks = _timed("capture_gather", transfer.gather_blocks)
transfer.put_cache = _timed("encode", transfer.put_cache)
transfer.open_entry = _timed("open", transfer.open_entry)
entries.Opened.restore = _timed("decode", entries.Opened.restore)  # type: ignore[method-assign]


class TimedKvtoolConnector(KvtoolConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        global _store
        side = self.connector_scheduler or self.connector_worker
        assert side is not None
        _store = side.store
        for tier in getattr(_store, "tiers", [_store]):
            tier._read_result = _timed("fetch", tier._read_result)
        if self.connector_worker is not None:
            save_entry = self.connector_worker._save_entry

            def timed_save(entry_id: str, keys: list, values: list) -> None:
                _timed("save", save_entry)(entry_id, keys, values)
                _dump()

            self.connector_worker._save_entry = timed_save  # type: ignore[method-assign]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return _timed("lookup", super().get_num_new_matched_tokens)(request, num_computed_tokens)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        plan = self._plan()
        loads = plan is not None and bool(plan.loads)
        _timed("restore", super().start_load_kv)(forward_context, **kwargs)
        if loads:
            _dump()

    def wait_for_layer_load(self, layer_name: str) -> None:
        _timed("layer_wait", super().wait_for_layer_load)(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        _timed("capture", super().save_kv_layer)(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        _timed("step_end", super().wait_for_save)()

    def shutdown(self) -> None:
        _dump()
        super().shutdown()
