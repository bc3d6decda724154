"""kvtool as an L2 adapter of LMCache's multi-process server (``lmcache server --l2-adapter``).

LMCache calls an adapter from its store and prefetch controller threads with
non-blocking tasks: store a batch of (key, memory object), look a batch of
keys up, load a batch into memory objects it owns; each finished task is
signalled on that kind's event fd and collected by a poll. Here every key of a
task is one job on a small thread pool: a store encodes the object's bytes with
the recipe (no copy on the way in) and puts the .kvz into the store; a load gets
the entry and decodes it straight into the destination object (``kvtool.entries``),
the layers of one chunk shared by the workers a task of fewer chunks leaves idle. Any
failure (missing, damaged, a store that is down, another layout) leaves that
key's bit unset: LMCache then treats it as a miss and never sees wrong bytes.
Each key succeeds or fails alone: a store task whose key failed reports failure
(LMCache's store result is per task; it then keeps every key of it in L1), while
its other keys are stored, reported to LMCache and counted in its usage. A
lookup locks each hit (pins it in the store, so the store's own eviction keeps
it) until LMCache unlocks it.

The store is any kvtool store URL; with a persistent one (file, Redis) a
restarted server finds every chunk again (``reindex``) and reports them to
LMCache. Counters appear in LMCache's ``/status`` (``report_status``) beside the
store's own ``stats()``, and bytes per cache salt in ``get_usage``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2AdapterListener, L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

from kvtool.entries import Miss, put_cache
from kvtool.entries.names import ChunkName
from kvtool.errors import KvtoolError
from kvtool.integrations.lmcache.chunks import ChunkLayout, restore_chunk
from kvtool.integrations.lmcache.index import ChunkIndex, Counters, Locks, reindex
from kvtool.integrations.lmcache.settings import OPTIONS, AdapterSettings
from kvtool.modeldict import registry as dictionaries
from kvtool.recipe import Recipe
from kvtool.store import LRUPolicy, Store, StoreEvent, dicts, open_store

log = logging.getLogger("kvtool.lmcache")


class KvtoolL2AdapterConfig(L2AdapterConfigBase):
    """LMCache's config object for the adapter: the checked ``adapter_params``."""

    def __init__(self, settings: AdapterSettings) -> None:
        self.settings = settings

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KvtoolL2AdapterConfig":
        try:
            return cls(AdapterSettings.from_params(d))
        except KvtoolError as exc:
            raise ValueError(str(exc)) from None  # LMCache reports a ValueError from a config as a usage error

    @classmethod
    def help(cls) -> str:
        return ("kvtool L2 adapter (adapter_params): " + ", ".join(OPTIONS) + "\n"
                '{"type": "plugin", "module_path": "kvtool.integrations.lmcache", "class_name": "KvtoolL2Adapter", '
                '"adapter_params": {"store": "file:///var/cache/kvtool"}}')


def layout_of(obj: MemoryObj) -> ChunkLayout:
    meta = obj.metadata
    shapes = meta.shapes or [meta.shape]
    dtypes = meta.dtypes or [meta.dtype]
    return ChunkLayout.of([tuple(s) for s in shapes], [str(d) for d in dtypes], obj.get_size())


def bytes_of(obj: MemoryObj) -> np.ndarray:
    """The object's bytes as a flat uint8 array over its memory (LMCache cannot give an empty object's)."""
    return np.frombuffer(obj.byte_array, np.uint8) if obj.get_size() else np.empty(0, np.uint8)


def _object_key(name: ChunkName) -> ObjectKey:
    return ObjectKey(chunk_hash=name.chunk_hash, model_name=name.model, kv_rank=name.kv_rank,
                     object_group_id=name.group, cache_salt=name.salt)


class KvtoolL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter over a kvtool store; see the module docstring."""

    def __init__(self, config: KvtoolL2AdapterConfig | dict[str, Any], l1_memory_desc: Any = None) -> None:
        super().__init__()
        settings = config.settings if isinstance(config, KvtoolL2AdapterConfig) else AdapterSettings.from_params(config)
        self.settings = settings
        self.counters = Counters()
        # A single tier is a one-tier stack: evictions arrive as its events either way.
        self._store: Store = open_store(settings.store, policy=LRUPolicy())
        try:
            self.recipe = settings.recipe
            # entries coded with a dictionary decode in every process that reads the store
            self._dictionary_source = dicts.source(self._store)
            dictionaries.attach(self._dictionary_source)
            if settings.dictionary is not None:
                dictionary = dictionaries.load(settings.dictionary)
                self.recipe = f"{Recipe.parse(self.recipe).codec.codec_id}:{dictionary.id}"
                if not dicts.publish(self._store, dictionary):
                    raise KvtoolError(f"the store refused the dictionary of {self.recipe}")
            self._index: ChunkIndex[ObjectKey] = ChunkIndex()
            self._locks = Locks(self._store)
            keys, store_keys, sizes = reindex(self._store, self.recipe, _object_key)
            for key, store_key, size in zip(keys, store_keys, sizes):
                self._index.add(key, store_key, size)
            if keys:
                self._notify_keys_stored(keys, sizes)
                log.info("kvtool L2 adapter: found %d chunks (%d bytes) in %s", len(keys), sum(sizes),
                         self._store.describe())
            self.counters.add("chunks_reindexed", len(keys))
            self._watch_evictions()
        except BaseException:
            self._store.close()
            raise
        self._efds = {kind: create_event_notifier() for kind in ("store", "lookup", "load")}
        self._pool = ThreadPoolExecutor(max_workers=settings.workers, thread_name_prefix="kvtool-l2")
        self._lock = threading.Lock()
        self._next_task: L2TaskId = 0
        self._done_stores: dict[L2TaskId, L2StoreResult] = {}
        self._done_lookups: dict[L2TaskId, Bitmap] = {}
        self._done_loads: dict[L2TaskId, Bitmap] = {}
        self._closed = False
        self._warned_bytes = False
        log.info("kvtool L2 adapter: store %s, recipe %s, %d workers", self._store.describe(), self.recipe,
                 settings.workers)

    # -- event fds ---------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        fd: int = self._efds["store"].fileno()
        return fd

    def get_lookup_and_lock_event_fd(self) -> int:
        fd: int = self._efds["lookup"].fileno()
        return fd

    def get_load_event_fd(self) -> int:
        fd: int = self._efds["load"].fileno()
        return fd

    # -- tasks -----------------------------------------------------------------------------
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task = self._new_task()

        def finish(results: list[Any]) -> None:
            results = [r or (False, 0) for r in results]
            stored = [(key, size) for key, (ok, size) in zip(keys, results) if ok and size]
            try:
                if stored:
                    self._notify_keys_stored([k for k, _ in stored], [s for _, s in stored])
            finally:
                with self._lock:
                    self._done_stores[task] = L2StoreResult(all(ok for ok, _ in results), sum(s for _, s in stored))
        self._run(len(keys), lambda i: self._store_one(keys[i], objects[i]), finish, "store")
        return task

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._done_stores = self._done_stores, {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]) -> L2TaskId:
        task = self._new_task()

        def finish(results: list[Any]) -> None:
            with self._lock:
                self._done_lookups[task] = _bitmap(results)
        self._run(1 if keys else 0, lambda _: self._lookup(keys), lambda r: finish(r[0] or [False] * len(keys) if r else []),
                  "lookup")
        return task

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done_lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Release one lock of each key (a key locked by several lookups stays pinned until the last unlock).

        Never fails: a key not locked, or a store closed meanwhile, is nothing to release."""
        for key in keys:
            self._locks.release(self._name(key).key)

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task = self._new_task()

        def finish(results: list[Any]) -> None:
            with self._lock:
                self._done_loads[task] = _bitmap(results)
            loaded = [key for key, ok in zip(keys, results) if ok]
            if loaded:
                self._notify_keys_accessed(loaded)
        # a task of fewer chunks than workers: each chunk's layers shared by the workers left over
        threads = max(1, self.settings.workers // max(1, len(keys)))
        self._run(len(keys), lambda i: self._load_one(keys[i], objects[i], threads), finish, "load")
        return task

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done_loads.pop(task_id, None)

    def _new_task(self) -> L2TaskId:
        with self._lock:
            task = self._next_task
            self._next_task += 1
        return task

    def _run(self, count: int, job: Callable[[int], Any], finish: Callable[[list[Any]], None], kind: str) -> None:
        """Run ``job(i)`` for ``i < count`` on the pool; when all are done, ``finish(results)`` and signal ``kind``'s fd.

        A job that raised leaves None as its result."""
        results: list[Any] = [None] * count
        left = [count]
        gate = threading.Lock()

        def complete() -> None:
            try:
                finish(results)
            except Exception:
                log.exception("kvtool L2 adapter: finishing a %s task failed", kind)
            self._efds[kind].notify()

        def one(i: int) -> None:
            try:
                results[i] = job(i)
            except Exception:  # a job reports its own failures; this is a bug, still a miss
                log.exception("kvtool L2 adapter: a %s job failed", kind)
                self.counters.add("internal_errors")
            with gate:
                left[0] -= 1
                last = left[0] == 0
            if last:
                complete()

        if count == 0:
            self._pool.submit(complete)  # finished after submit_* has returned its id
        for i in range(count):
            self._pool.submit(one, i)

    # -- one key -----------------------------------------------------------------------------
    def _name(self, key: ObjectKey) -> ChunkName:
        return ChunkName(bytes(key.chunk_hash), key.model_name, key.kv_rank, key.object_group_id, key.cache_salt,
                         self.recipe)

    def _store_one(self, key: ObjectKey, obj: MemoryObj) -> tuple[bool, int]:
        """(stored or already there, bytes written now)."""
        name = self._name(key)
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            if self._store.contains(name.key):
                self.counters.add("chunks_already_stored")
                return True, 0
            layout = layout_of(obj)
            if layout.kind == "bytes" and not self._warned_bytes:
                self._warned_bytes = True
                meta = obj.metadata
                log.warning("kvtool L2 adapter: chunks shaped %s (%s) are not one KV tensor [2, layers, tokens, "
                            "hidden] of a float type; they are kept as bytes, at a lower ratio",
                            [list(s) for s in (meta.shapes or [meta.shape])], meta.dtypes or [meta.dtype])
            cache = layout.cache(bytes_of(obj), key.model_name)
            put = put_cache(self._store, name.key, cache, self.recipe, meta=name.meta())
        except KvtoolError as exc:
            log.warning("kvtool L2 adapter: cannot store chunk %s: %s", name.key, exc)
            self.counters.add("store_failures", label="encode")
            return False, 0
        if not put.stored:
            if put.cause == "encode":
                log.warning("kvtool L2 adapter: cannot store chunk %s: %s", name.key, put.detail)
            self.counters.add("store_failures", label=put.cause)
            return False, 0
        if not self._index.add(key, name.key, put.stored_bytes):  # stored meanwhile by another task: counted there
            self.counters.add("chunks_already_stored")
            return True, 0
        self.counters.add("chunks_stored", label=layout.kind)
        self.counters.add("stored_raw_bytes", layout.nbytes)
        self.counters.add("stored_bytes", put.stored_bytes)
        self.counters.add("store_cpu_seconds", time.thread_time() - cpu)
        self.counters.add("store_wall_seconds", time.perf_counter() - wall)
        return True, put.stored_bytes

    def _lookup(self, keys: list[ObjectKey]) -> list[bool]:
        """Which keys the store holds, each hit locked (pinned in the store) until ``submit_unlock``."""
        store_keys = [self._name(key).key for key in keys]
        try:
            held = self._store.contains_many(store_keys)
        except KvtoolError as exc:
            log.warning("kvtool L2 adapter: lookup failed (%s); answering misses", exc)
            held = [False] * len(keys)
        found = [bool(hit) and self._locks.take(store_key) for hit, store_key in zip(held, store_keys)]
        self.counters.add("lookups", len(keys))
        self.counters.add("lookup_hits", sum(found))
        return list(found)

    def _load_one(self, key: ObjectKey, obj: MemoryObj, threads: int = 1) -> bool:
        name = self._name(key)
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            layout = layout_of(obj)
            out = bytes_of(obj)
        except (KvtoolError, TypeError, ValueError) as exc:  # a destination that is not writable memory
            log.warning("kvtool L2 adapter: cannot write chunk %s into its destination (%s); a miss", name.key, exc)
            self.counters.add("load_failures", label="mismatch")
            return False
        restored = restore_chunk(self._store, name.key, layout, out, threads=threads)
        if not restored.ok:
            assert restored.miss is not None
            if restored.miss.value in ("damaged", "undecodable"):
                log.warning("kvtool L2 adapter: chunk %s is %s (%s); a miss", name.key, restored.miss.value, restored.detail)
            self.counters.add("load_failures", label=_LOAD_FAILURE[restored.miss])
            return False
        self.counters.add("chunks_loaded")
        self.counters.add("loaded_raw_bytes", layout.nbytes)
        self.counters.add("loaded_bytes", restored.stored_bytes)
        self.counters.add("load_cpu_seconds", time.thread_time() - cpu)
        self.counters.add("load_wall_seconds", time.perf_counter() - wall)
        return True

    # -- eviction and deletion -------------------------------------------------------------
    def delete(self, keys: list[ObjectKey]) -> None:
        deleted, sizes = [], []
        for key in keys:
            try:
                self._store.delete(self._name(key).key)
            except KvtoolError as exc:
                log.warning("kvtool L2 adapter: cannot delete a chunk (%s)", exc)
                continue
            self._locks.forget(self._name(key).key)
            size = self._index.pop(key)
            if size is not None:
                deleted.append(key)
                sizes.append(size)
        if deleted:
            self._notify_keys_deleted(deleted, sizes)

    def _watch_evictions(self) -> None:
        """Tell LMCache of the chunks the store drops by itself (a bounded tier that fills up)."""
        def gone(store_keys: list[str]) -> None:
            dropped = [known for known in map(self._index.pop_store_key, store_keys) if known is not None]
            if dropped:
                self.counters.add("chunks_evicted", len(dropped))
                self._notify_keys_deleted([k for k, _ in dropped], [s for _, s in dropped])

        def on_event(event: StoreEvent) -> None:
            if event.kind == "evicted":
                gone([event.key])
        self._store.subscribe(on_event)

    def register_listener(self, listener: L2AdapterListener) -> None:
        """Register ``listener`` and tell it of the chunks already held (those found again at startup)."""
        super().register_listener(listener)
        keys, sizes = self._index.items()
        if keys:
            listener.on_l2_keys_stored(keys, sizes)

    # -- status and lifecycle ----------------------------------------------------------------
    def report_status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "is_healthy": not self._closed, "type": type(self).__name__, "store": self._store.describe(),
            "recipe": self.recipe, "workers": self.settings.workers, "chunks_indexed": len(self._index),
            "chunks_locked": len(self._locks),
            "counters": self.counters.snapshot(),
        }
        try:
            status["store_stats"] = self._store.stats()
        except KvtoolError as exc:
            status["is_healthy"] = False
            status["store_error"] = str(exc)
        return status

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        dictionaries.detach(self._dictionary_source)
        self._store.close()
        for efd in self._efds.values():
            efd.close()
        log.info("kvtool L2 adapter closed")


#: How a restore's miss is counted among the load failures (``load_failures|<label>``).
_LOAD_FAILURE = {Miss.MISSING: "missing", Miss.DAMAGED: "damaged", Miss.UNREACHABLE: "unreachable",
                 Miss.MISMATCH: "mismatch", Miss.UNDECODABLE: "decode_error"}


def _bitmap(results: list[Any]) -> Bitmap:
    bitmap = Bitmap(len(results))
    for i, ok in enumerate(results):
        if ok:
            bitmap.set(i)
    return bitmap

