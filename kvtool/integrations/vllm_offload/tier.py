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
- ``submit_store`` hands the job to one copier thread, which copies each
  chunk's row out of vLLM's CPU region and reports the job finished at once,
  so vLLM may evict and reuse those rows while the copies are encoded and
  stored on a pool of ``workers`` threads. A chunk waiting there is a hit and
  loads from its copy. At most ``max_pending_stores`` chunks wait: the chunks
  of a store beyond that are dropped at once, the first ones kept (the job is
  reported failed, the dropped chunks stay in vLLM's CPU tier only). vLLM's own
  ``backpressure`` option applies on top, as for any tier;
- ``submit_load`` restores each chunk of the job on the pool, one by one: the
  chunks that restored are reported (``successful_keys``), the others are
  recomputed by vLLM and looked up as misses from then on;
- ``get_finished_jobs`` hands back what finished, in the order it finished.

Every chunk succeeds or fails on its own: a chunk that cannot be copied, coded,
stored or restored never takes the others of its job with it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, ClassVar

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

    def __init__(self, store: Store, namer: ChunkNamer, tier_type: str, waiting: Callable[[OffloadKey], bool]) -> None:
        self._store = store
        self._namer = namer
        self._waiting = waiting
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        """A chunk copied out and waiting to be stored is a hit; the store answers for the others."""
        waiting = [self._waiting(k) for k in keys]
        asked = [k for k, w in zip(keys, waiting) if not w]
        found = iter(self._store.contains_many([self._namer.key(k) for k in asked]))
        return [w or bool(next(found)) for w in waiting]


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
        self._pending_stores = 0  # chunks accepted for storing and not yet stored (or failed)
        self._waiting: dict[OffloadKey, np.ndarray] = {}  # copied out of vLLM's rows, not yet stored
        self.stores_dropped = 0  # chunks not accepted: too many waiting
        self.stores_failed = 0  # chunks accepted that could not be coded or stored
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="kvtool-tier-copy")
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvtool-tier")
        self._lookups = _StoreLookup(self.store, self.namer, tier_type, self._is_waiting)
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
        self._copier.submit(self._copy_job, job_metadata.job_id, keys, rows, complete)

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
        """Wait until every job has finished: no copy or load touches vLLM's rows any more (the copies of
        chunks may still be waiting to be stored: ``wait_stored``)."""
        with self._idle:
            self._idle.wait_for(lambda: self._jobs == 0)

    def wait_stored(self) -> None:
        """Wait until every chunk accepted so far is stored, or has failed."""
        with self._idle:
            self._idle.wait_for(lambda: self._jobs == 0 and self._pending_stores == 0)

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._copier.shutdown(wait=True)
        self._pool.shutdown(wait=True)  # the chunks copied out are still stored
        self.store.close()
        # Let go of vLLM's shared region, which vLLM closes next: a live view would keep it mapped.
        self._region = np.empty((0, 0), np.uint8)

    # -- copier and pool threads -------------------------------------------------------------
    def _is_waiting(self, key: OffloadKey) -> bool:
        with self._idle:
            return key in self._waiting

    def _copy_job(self, job_id: int, keys: list[OffloadKey], rows: list[int], complete: bool) -> None:
        """Copy each chunk's row out, report the job finished (vLLM releases the rows), then queue the copies to be
        coded and stored. The job succeeds when every chunk was copied (``complete``: none was dropped)."""
        start, copies = time.monotonic(), []
        for key, row in zip(keys, rows):
            try:
                copies.append((key, self._region[row, :self.layout.used_bytes].copy()))
            except Exception:  # on the copier thread: this chunk is not stored, the others are
                log.exception("kvtool tier: chunk %d of store job %d could not be copied", row, job_id)
        with self._idle:
            fresh = [(key, data) for key, data in copies if key not in self._waiting]
            self._waiting.update(fresh)
            self._pending_stores -= len(keys) - len(fresh)
            self.stores_failed += len(keys) - len(copies)
        self._finish(JobResult(job_id=job_id, success=complete and len(copies) == len(keys),
                               transfer_time=time.monotonic() - start,
                               transfer_bytes=len(copies) * self.block_size_bytes or None), [])
        for key, data in fresh:
            self._pool.submit(self._store_one, key, data)

    def _store_one(self, key: OffloadKey, data: np.ndarray) -> None:
        """Code and store one copied chunk (unless the store holds it already)."""
        ok = False
        try:
            name = self.namer.key(key)
            ok = self.store.contains(name) or save_row(self.store, name, data[None], 0, self.layout, self.recipe)
        except Exception:  # on a pool thread: this chunk is not stored
            log.exception("kvtool tier: a chunk could not be stored")
        finally:
            with self._idle:
                self._waiting.pop(key, None)
                self._pending_stores -= 1
                self.stores_failed += not ok
                self._idle.notify_all()

    def _load_job(self, job_id: int, keys: list[OffloadKey], rows: list[int]) -> None:
        """Restore each chunk into its row: from its copy while it waits to be stored, else from the store."""
        start, loaded = time.monotonic(), []
        for key, row in zip(keys, rows):
            try:
                with self._idle:
                    copy = self._waiting.get(key)
                if copy is not None:
                    self._region[row, :copy.size] = copy
                    loaded.append(key)
                elif load_row(self.store, self.namer.key(key), self._region, row, self.layout, self._offsets):
                    loaded.append(key)
            except Exception:  # on a pool thread: this chunk is a miss, the others are not
                log.exception("kvtool tier: chunk %d of load job %d could not be restored", row, job_id)
        done = set(loaded)
        failed = [k for k in keys if k not in done]
        partial = tuple(loaded) if failed and loaded else None
        self._finish(JobResult(job_id=job_id, success=not failed, successful_keys=partial,
                               transfer_time=time.monotonic() - start,
                               transfer_bytes=len(loaded) * self.block_size_bytes or None), failed)

    def _finish(self, result: JobResult, failed: list[OffloadKey]) -> None:
        """Queue a finished job for ``get_finished_jobs`` (with the keys that are misses from now on)."""
        with self._idle:
            self._jobs -= 1
            self._finished.put((result, failed))
            self._idle.notify_all()
