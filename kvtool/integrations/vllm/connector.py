"""``KvtoolConnector``: vLLM's KV-connector interface over a kvtool store.

Scheduler side (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``): finds the longest stored prefix past vLLM's own
prefix-cache hit and plans, per step, which entries to restore into which
blocks and which finished prompt blocks to save (``plan``). Loads are
synchronous from vLLM's point of view: they complete within the step that
needs them, layer by layer.

Worker side (``register_kv_caches``, ``start_load_kv``, ``wait_for_layer_load``,
``save_kv_layer``, ``wait_for_save``): moves KV between the store and the paged
tensors (``transfer``), and reports blocks it could not restore through
``get_block_ids_with_load_errors`` so vLLM recomputes them.

The two sides may live in different processes (vLLM's default on its CPU
build and with several workers): they meet in the store's shared tiers (file,
Redis). Both report what they do through vLLM's KV-connector stats
(``stats``, ``metrics``): vLLM's periodic log line and ``/metrics``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtool.cache import ModelFacts
from kvtool.errors import UsageError
from kvtool.integrations.vllm import SUPPORTED_VLLM, shared_store
from kvtool.integrations.vllm.dictionary import DictionaryKeeper
from kvtool.integrations.vllm.paged import kv_views
from kvtool.integrations.vllm.plan import (
    EntryNamer,
    LoadJob,
    RequestState,
    SaveJob,
    StepPlan,
    entries_to_save,
    find_stored_prefix,
    load_jobs,
    tokens_in,
)
from kvtool.integrations.vllm.metrics import KvtoolConnectorStats, KvtoolPromMetrics
from kvtool.integrations.vllm.settings import ConnectorSettings
from kvtool.integrations.vllm.stats import StatsCollector, merge, summary
from kvtool.integrations.vllm.transfer import Capture, PagedLayers, Restore, encode_and_store
from kvtool.recipe import Recipe

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtool.vllm")

# Hash functions whose block hashes vLLM seeds per process unless PYTHONHASHSEED is set.
_REPRODUCIBLE_HASHES = ("sha256", "sha256_cbor")
STORE_SAMPLE_S = 5.0  # how often the worker reports what the store's tiers hold


class KvtoolConnectorMetadata(KVConnectorMetadata):
    """The scheduler's plan for one step, handed to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KvtoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        _check_vllm_version()
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._settings = ConnectorSettings.from_extra_config(extra)
        cache, model, parallel = vllm_config.cache_config, vllm_config.model_config, vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise UsageError("the kvtool connector does not support pipeline parallelism yet")
        self._block_size = cache.block_size
        self._per_entry = self._settings.blocks_per_entry(self._block_size)
        kv_dtype = str(model.dtype) if cache.cache_dtype == "auto" else str(cache.cache_dtype)
        self._namer = EntryNamer(
            self._settings.model_id or str(model.model),
            Recipe.parse(self._settings.recipe).spec(),
            kv_dtype,
            self._block_size,
            parallel.tensor_parallel_size,
        )
        self._facts = ModelFacts(
            model_id=self._namer.model_id,
            architecture=(getattr(model.hf_config, "architectures", None) or ["unknown"])[0],
            num_layers=model.get_num_layers(parallel),
            num_kv_heads=model.get_num_kv_heads(parallel),
            head_dim=model.get_head_size(),
            keys_post_rope=True,
        )
        if cache.prefix_caching_hash_algo not in _REPRODUCIBLE_HASHES and os.getenv("PYTHONHASHSEED") is None:
            log.warning(
                "prefix_caching_hash_algo=%s without PYTHONHASHSEED: vLLM's block hashes differ in every "
                "process, so entries saved by one vLLM process are never found by another",
                cache.prefix_caching_hash_algo,
            )
        self._store = self._open_store(parallel.distributed_executor_backend)
        self._dicts = DictionaryKeeper(self._settings.dictionary, self._settings.recipe, self._store, self._facts)
        self._released = False
        self._stats = StatsCollector()
        self._totals: dict = {"counts": {}, "samples": {}, "gauges": {}}  # for the shutdown line
        self._totals_logged = False
        self._store_sampled = 0.0
        self._log_totals_on_signals()
        self._api = None
        if self._settings.api is not None and role == KVConnectorRole.SCHEDULER:
            from kvtool.server.embedded import start_in_vllm

            self._api = start_in_vllm(self._store, self._settings.api, self._settings, self._namer, vllm_config)
        # scheduler side
        self._requests: dict[str, RequestState] = {}
        self._pending_loads: dict[str, list[LoadJob]] = {}
        # worker side
        self._rank = _tensor_parallel_rank() if role == KVConnectorRole.WORKER else 0
        self._layers: PagedLayers | None = None
        self._overlap = False  # set by register_kv_caches from the settings and the device
        self._restore: Restore | None = None
        self._capture: Capture | None = None
        self._load_errors: set[int] = set()
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvtool-save") if role == KVConnectorRole.WORKER else None

    def _open_store(self, executor: Any):
        """The store both sides use; a store with no tier other processes reach needs them in one process."""
        url = self._settings.store
        store = shared_store.acquire(url, self._settings.write_behind)
        if executor != "uni" and not store.shared:
            shared_store.release(url)
            raise UsageError(
                f"store {store.describe()} lives in one process, but vLLM runs its scheduler and workers in "
                "separate processes here: add a tier they share, e.g. "
                f"'{url},file:///var/cache/kvtool' (or redis://), or run vLLM in one process"
            )
        lossy = " (lossy: restored prefixes are approximations)" if Recipe.parse(self._namer.recipe).lossy else ""
        log.info("kvtool store %s (%s side), recipe %s%s, %d blocks per entry", store.describe(),
                 self.role.name.lower(), self._namer.recipe, lossy, self._per_entry)
        return store

    # ==== scheduler side ==================================================================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        bs = self._block_size
        hashes = request.block_hashes
        state = RequestState(hashes, request.num_prompt_tokens)
        self._requests[request.request_id] = state
        if len(hashes) != request.num_tokens // bs:
            log.debug("request %s: block hashes do not match block size %d; not using kvtool", request.request_id, bs)
            return 0, False
        try:
            state.stored = find_stored_prefix(
                hashes, (request.num_tokens - 1) // bs, self._per_entry, self._namer, self._store.contains_many,
                tokens_in(self._store),
            )
        except Exception:
            log.exception("request %s: kvtool store lookup failed; computing the prompt", request.request_id)
            state.stored = []
        state.local_tokens = num_computed_tokens
        restored = state.restored_blocks()
        state.saved_blocks = restored - restored % self._per_entry
        new_tokens = max(0, restored * bs - num_computed_tokens)
        self._stats.count("lookups")
        self._stats.count("lookup_hits", 1 if new_tokens else 0)
        self._stats.count("tokens_found", new_tokens)
        log.debug("request %s: %d tokens found in the kvtool store (vLLM had %d)",
                  request.request_id, new_tokens, num_computed_tokens)
        return new_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens == 0:
            return
        local = state.local_tokens // self._block_size
        limit = local + num_external_tokens // self._block_size
        jobs = load_jobs(state.stored, local, blocks.get_block_ids()[0], limit)
        if jobs:
            self._pending_loads[request.request_id] = jobs

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        plan = StepPlan(loads=self._pending_loads)
        self._pending_loads = {}
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._plan_saves(new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0), plan)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            self._plan_saves(req_id, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), plan)
        return KvtoolConnectorMetadata(plan)

    def _plan_saves(self, req_id: str, state: RequestState, computed_tokens: int, plan: StepPlan) -> None:
        spans = entries_to_save(
            state.block_hashes, state.prompt_tokens // self._block_size, computed_tokens // self._block_size,
            state.saved_blocks, self._per_entry, self._namer,
        )
        for span in spans:
            if span.end > len(state.block_ids):
                break
            plan.saves.setdefault(req_id, []).append(SaveJob(span.entry_id, state.block_ids[span.start:span.end]))
            state.saved_blocks = span.end

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """Blocks that failed to restore are recomputed by vLLM: save them again afterwards."""
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for state in self._requests.values():
            bad = [i for i, block in enumerate(state.block_ids) if block in invalid]
            if bad:
                state.saved_blocks = min(state.saved_blocks, bad[0] - bad[0] % self._per_entry)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None

    # ==== worker side =====================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        backend = _attention_backend(self._vllm_config)
        head_dim = self._facts.head_dim
        views = [kv_views(t, backend, head_dim, self._block_size) for t in kv_caches.values()]
        first = next(iter(kv_caches.values()))
        self._layers = PagedLayers(
            list(kv_caches), [k for k, _ in views], [v for _, v in views], self._block_size, first.dtype
        )
        overlap = self._settings.overlap
        self._overlap = first.device.type != "cpu" if overlap is None else overlap
        log.info("kvtool: %d layers, paged KV %s %s on %s (backend %s), restore %s", len(views), list(first.shape),
                 first.dtype, first.device, backend, "overlapped with compute" if self._overlap else "before the forward pass")

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        plan = self._plan()
        if plan is None or not plan.loads or self._layers is None:
            return
        self._restore = Restore(
            self._store, lambda entry_id: self._namer.key(entry_id, self._rank), self._layers, plan.loads,
            self._stats,
        )
        self._restore.start(background=self._overlap)
        if not self._overlap:
            for index in range(len(self._layers.names)):
                self._restore.copy_layer(index)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._restore is not None and self._layers is not None:
            self._restore.copy_layer(self._layers.index(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is None or not plan.saves or self._layers is None:
            return
        if self._capture is None or self._capture.jobs is not plan.saves:
            self._capture = Capture(plan.saves, len(self._layers.names))
        self._capture.take_layer(self._layers.index(layer_name), self._layers)

    def wait_for_save(self) -> None:
        failed_requests: set[str] = set()
        if self._restore is not None:
            failed_blocks = self._restore.finish()
            self._load_errors |= failed_blocks
            failed_requests = self._restore.failed_requests()
            self._restore = None
        if self._capture is not None and self._saver is not None:
            for entry_id, keys, values in self._capture.complete_entries(failed_requests):
                self._saver.submit(self._save_entry, entry_id, keys, values)
            self._capture = None

    def _save_entry(self, entry_id: str, keys: list, values: list) -> None:
        key = self._namer.key(entry_id, self._rank)
        start = time.perf_counter()
        try:
            recipe = self._dicts.recipe_for(keys, values)
            stored = encode_and_store(self._store, key, keys, values, recipe, self._facts)
        except Exception:
            log.exception("kvtool: saving entry %s failed", entry_id[:16])
            stored = 0
        self._stats.observe("save_seconds", time.perf_counter() - start)
        if stored:
            self._stats.count("entries_saved")
            self._stats.count("saved_bytes", stored)
            self._stats.count("saved_raw_bytes", sum(a.nbytes for a in keys) + sum(a.nbytes for a in values))
        else:
            self._stats.count("save_failures")
        log.debug("kvtool: entry %s %s", entry_id[:16], "stored" if stored else "not stored")

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ==== stats ===========================================================================

    def get_kv_connector_stats(self) -> KvtoolConnectorStats | None:
        """What this side did since vLLM last asked (both sides are asked after every step)."""
        now = time.monotonic()
        if self._saver is not None and self._rank == 0 and now - self._store_sampled >= STORE_SAMPLE_S:
            self._store_sampled = now  # counting a large store's entries takes a moment: not on the step's path
            self._saver.submit(self._sample_store)
        data = self._stats.take()
        if data is None:
            return None
        merge(self._totals, data)
        return KvtoolConnectorStats(data)

    def _sample_store(self) -> None:
        try:
            self._stats.sample_store(self._store)
        except Exception:
            log.exception("kvtool: reading the store's stats failed")

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtoolConnectorStats:
        return KvtoolConnectorStats.from_payload(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvtoolPromMetrics:
        return KvtoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._released:
            return
        self._released = True
        if self._api is not None:
            self._api.stop()
        if self._saver is not None:
            self._saver.shutdown(wait=True)
        data = self._stats.take()
        if data is not None:
            merge(self._totals, data)
        self._log_totals()
        shared_store.release(self._settings.store)

    def _log_totals(self) -> None:
        """The process's totals, once: at shutdown, or when the signal that ends the process arrives."""
        if self._totals_logged:
            return
        self._totals_logged = True
        done = summary(self._totals)
        if self.role == KVConnectorRole.SCHEDULER:
            log.info("kvtool at shutdown (scheduler): %d lookups, %d hits (%d tokens found), %d misses",
                     done["lookups"], done["lookup_hits"], done["tokens_found"], done["lookups"] - done["lookup_hits"])
        else:
            log.info("kvtool at shutdown (worker %d): %d tokens restored, %d restore failures, %d entries saved "
                     "(%.1f MB stored, ratio %s)", self._rank, done["tokens_restored"], done["restore_failures"],
                     done["entries_saved"], done["saved_MB"], done.get("compression_ratio", "-"))

    def _log_totals_on_signals(self) -> None:
        """Log the totals when SIGTERM or SIGINT arrives, before vLLM's own handler runs.

        With ``--shutdown-timeout 0`` (vLLM's default) the API server kills the
        engine process right after its SIGTERM, before ``shutdown()`` runs; the
        totals up to the last engine step are logged from the handler instead.
        Only where vLLM installed a handler of its own (the main thread of its
        engine and worker processes).
        """
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(signum)
            if callable(previous):
                def handler(sig: int, frame: Any, previous: Any = previous) -> None:
                    self._log_totals()
                    previous(sig, frame)

                signal.signal(signum, handler)

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KvtoolConnectorMetadata) else None


def _log_like_vllm() -> None:
    """Show kvtool's log lines where and as vLLM shows its own, unless the user configured the kvtool logger.

    vLLM configures only its ``vllm`` logger; without this, kvtool's INFO lines
    (startup, shutdown) are hidden unless VLLM_LOGGING_CONFIG_PATH names them.
    """
    kvtool_log = logging.getLogger("kvtool")
    vllm_log = logging.getLogger("vllm")
    if kvtool_log.handlers or not vllm_log.handlers:
        return
    for handler in vllm_log.handlers:
        kvtool_log.addHandler(handler)
    kvtool_log.setLevel(vllm_log.level)
    kvtool_log.propagate = False


def _check_vllm_version() -> None:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        log.warning("kvtool's vLLM connector is tested with vLLM %s, not %s: check docs/VLLM.md",
                    " and ".join(f"{v}.x" for v in SUPPORTED_VLLM), version)


def _tensor_parallel_rank() -> int:
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return 0


def _attention_backend(vllm_config: "VllmConfig") -> str:
    """The name of the attention backend of the model's layers (the paged layout depends on it)."""
    for layer in vllm_config.compilation_config.static_forward_context.values():
        get_backend = getattr(layer, "get_attn_backend", None)
        if get_backend is not None:
            return get_backend().get_name()
    return "unknown"
