"""``KvtoolSecondaryTier``: a secondary tier of vLLM's ``TieringOffloadingSpec`` over any kvtool store.

vLLM keeps its own GPU <-> CPU offloading (its DMA, its CPU block pool, the
primary tier) and hands whole chunks to the tiers below. This one encodes each
chunk with a kvtool recipe and keeps it in a kvtool store (memory, file, Redis,
Redis Cluster, or a tiered stack of them), so chunks take less room, outlive the
process, are shared by every process that opens the store, and are seen by
kvtool's tools and HTTP API.

Everything vLLM calls runs in its scheduler process and returns at once:

- ``lookup`` asks the store on vLLM's own lookup thread (``AsyncLookupManager``,
  as vLLM's ``fs`` tier does) and answers RETRY until the answer is in;
- ``submit_store`` and ``submit_load`` queue the work on a bounded pool of
  ``workers`` threads; at most ``max_pending_stores`` chunks wait to be stored:
  the chunks of a store beyond that are dropped at once, the first ones kept
  (the job is reported failed, vLLM releases its rows, the dropped chunks stay
  in vLLM's CPU tier only). vLLM's own ``backpressure`` option applies on top,
  as for any tier;
- ``get_finished_jobs`` hands back what finished. A chunk that cannot be
  restored is reported failed (vLLM recomputes it) and looked up as a miss
  from then on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from vllm import __version__ as vllm_version
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, ScheduleEndContext, SecondaryTierManager, TransferJob

from kvtool.errors import UsageError
from kvtool.integrations.vllm_offload import SUPPORTED_VLLM
from kvtool.integrations.vllm_offload.chunks import check_recipe, load_row, save_row
from kvtool.entries.names import ChunkNamer
from kvtool.integrations.vllm_offload.rows import RowLayout, chunk_namer
from kvtool.recipe import DEFAULT_RECIPE, Recipe
from kvtool.store import Store, open_store
from kvtool.store.tiered import DEFAULT_WRITE_BEHIND

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("kvtool.vllm.tier")


class _StoreLookup(AsyncLookupManager):
    """vLLM's asynchronous lookups, answered by the store's index."""

    def __init__(self, store: Store, namer: ChunkNamer, tier_type: str) -> None:
        self._store = store
        self._namer = namer
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._store.contains_many([self._namer.key(k) for k in keys])


class KvtoolSecondaryTier(SecondaryTierManager):
    """Keeps vLLM's offloaded chunks in a kvtool store, encoded with a kvtool recipe.

    Options (the tier's entry in ``secondary_tiers``): ``store`` (a kvtool store
    URL list, required), ``recipe`` (default ``exphuff``), ``head_dim`` (the
    model's head size: keys and values are then encoded as such; needed for the
    ``HND`` layout), ``model_id`` (the name that keys chunks, default the model
    vLLM serves), ``workers`` (threads encoding and decoding, default 2),
    ``max_pending_stores`` (chunks waiting to be stored before new stores are
    dropped, default 64), ``write_behind`` (with a memory tier over a persistent
    one, how many chunks may wait for their persistent copy; as in kvtool's
    connector), ``locality`` (``LOCAL`` or ``REMOTE``, for vLLM's tier filters).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: "OffloadingSpec",
        primary_kv_view: memoryview,
        tier_type: str,
        store: str | None = None,
        recipe: str = DEFAULT_RECIPE,
        head_dim: int | None = None,
        model_id: str | None = None,
        workers: int = 2,
        max_pending_stores: int = 64,
        write_behind: int = DEFAULT_WRITE_BEHIND,
        locality: str | None = None,
        backpressure_detector: "BackpressureDetector | None" = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if ".".join(vllm_version.split(".")[:2]) not in SUPPORTED_VLLM:
            log.warning("kvtool tier: tested with vLLM %s, not %s", ", ".join(SUPPORTED_VLLM), vllm_version)
        if not store or not isinstance(store, str):
            raise UsageError('kvtool tier: "store" (a kvtool store URL) is required')
        for name, value, least in (("workers", workers, 1), ("max_pending_stores", max_pending_stores, 1),
                                   ("write_behind", write_behind, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise UsageError(f"kvtool tier: {name} must be an integer of at least {least}, not {value!r}")
        try:
            self.locality = Locality(locality) if locality is not None else None
        except ValueError:
            raise UsageError(f"kvtool tier: locality must be LOCAL or REMOTE, not {locality!r}") from None
        replicated = bool(getattr(offloading_spec, "replicated_layout", False))
        self.layout = RowLayout.from_config(offloading_spec.config, self.block_size_bytes, replicated, head_dim)
        self.recipe = Recipe.parse(recipe).spec()
        check_recipe(self.layout, self.recipe)
        self.namer = chunk_namer(offloading_spec.config, self.recipe, self.layout, model_id)
        self._region = np.asarray(primary_kv_view).view(np.uint8)
        self._offsets = self.layout.row_offsets()
        self.store = open_store(store, write_behind=write_behind)
        self._max_pending = max_pending_stores
        self._finished: queue.SimpleQueue[tuple[JobResult, list[OffloadKey]]] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._jobs = 0  # submitted, not yet finished
        self._pending_stores = 0  # chunks of those jobs waiting to be stored
        self.stores_dropped = 0
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvtool-tier")
        self._lookups = _StoreLookup(self.store, self.namer, tier_type)
        log.info("kvtool tier over %s: recipe %s, rows %s", self.store.describe(), self.recipe, self.layout.signature())

    # -- lookups --------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    # -- transfers ------------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        rows = [int(c) for c in job_metadata.chunk_ids]
        with self._idle:
            room = max(0, self._max_pending - self._pending_stores)
            if room < len(keys):  # keep the first chunks (the prefix's start), drop the rest
                self.stores_dropped += len(keys) - room
                log.debug("%d of %d chunks not stored: %d already waiting", len(keys) - room, len(keys),
                          self._pending_stores)
                if not room:
                    self._finished.put((JobResult(job_id=job_metadata.job_id, success=False), []))
                    return
            complete = room >= len(keys)
            keys, rows = keys[:room], rows[:room]
            self._pending_stores += len(keys)
            self._jobs += 1
        self._pool.submit(self._store_job, job_metadata.job_id, keys, rows, complete)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        rows = [int(c) for c in job_metadata.chunk_ids]
        with self._idle:
            self._jobs += 1
        self._pool.submit(self._load_job, job_metadata.job_id, keys, rows)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        while True:
            try:
                result, failed = self._finished.get_nowait()
            except queue.Empty:
                return results
            if failed:
                self._lookups.mark_miss(failed)
            results.append(result)

    def has_pending_work(self) -> bool:
        with self._idle:
            return self._jobs > 0

    def drain_jobs(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._jobs == 0)

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._pool.shutdown(wait=True)
        self.store.close()
        # Let go of vLLM's shared region, which vLLM closes next: a live view would keep it mapped.
        self._region = np.empty((0, 0), np.uint8)

    # -- pool threads ---------------------------------------------------------------------
    def _store_job(self, job_id: int, keys: list[OffloadKey], rows: list[int], complete: bool) -> None:
        """Store the chunks; the job succeeds when all of them are stored (``complete``: none was dropped)."""
        start, settled, ok = time.monotonic(), 0, complete
        try:
            for key, row in zip(keys, rows):
                name = self.namer.key(key)
                if not self.store.contains(name):
                    ok = save_row(self.store, name, self._region, row, self.layout, self.recipe) and ok
                settled += 1
                with self._idle:
                    self._pending_stores -= 1
        except Exception:  # on a pool thread: reported as a failed store, vLLM carries on
            log.exception("kvtool tier: store job %d failed", job_id)
            ok = False
        finally:
            with self._idle:
                self._pending_stores -= len(keys) - settled
            moved = len(keys) * self.block_size_bytes if ok else None
            self._finish(JobResult(job_id=job_id, success=ok, transfer_time=time.monotonic() - start,
                                   transfer_bytes=moved), [])

    def _load_job(self, job_id: int, keys: list[OffloadKey], rows: list[int]) -> None:
        start, loaded = time.monotonic(), set()
        try:
            for key, row in zip(keys, rows):
                if load_row(self.store, self.namer.key(key), self._region, row, self.layout, self._offsets):
                    loaded.add(key)
        except Exception:  # on a pool thread: the chunks not loaded are misses
            log.exception("kvtool tier: load job %d failed", job_id)
        finally:
            failed = [k for k in keys if k not in loaded]
            partial = tuple(k for k in keys if k in loaded) if failed and loaded else None
            self._finish(JobResult(job_id=job_id, success=not failed, successful_keys=partial,
                                   transfer_time=time.monotonic() - start,
                                   transfer_bytes=len(loaded) * self.block_size_bytes or None), failed)

    def _finish(self, result: JobResult, failed: list[OffloadKey]) -> None:
        """Queue a finished job for ``get_finished_jobs`` (with the keys that are misses from now on)."""
        with self._idle:
            self._jobs -= 1
            self._finished.put((result, failed))
            self._idle.notify_all()
