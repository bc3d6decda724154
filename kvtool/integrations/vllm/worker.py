"""The connector's worker half: KV moves between the store and vLLM's paged tensors.

vLLM calls it in each worker process (``register_kv_caches``, then per step
``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``,
``wait_for_save``). It carries out the scheduler's ``StepPlan`` with
``transfer``'s ``Restore`` and ``Capture``, encodes and stores finished
entries on a background thread, and reports blocks it could not restore
through ``get_block_ids_with_load_errors`` so vLLM recomputes them; where vLLM
takes failures only per request (``ModelKV.per_request_failures``), it reports
each restored request as loaded, or failed, through ``take_finished_loads``.
It registers only the layers of KV cache groups kvtool stores, each with its
group, and none when kvtool restores nothing for the model (``context.refusal``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvtool.integrations.vllm.context import ConnectorContext, ConnectorSide
from kvtool.integrations.vllm.cpu_tiles import attention_isa, tile_orders
from kvtool.integrations.vllm.dictionary import DictionaryKeeper
from kvtool.integrations.vllm.paged import kv_views, typed
from kvtool.integrations.vllm.plan import StepPlan
from kvtool.integrations.vllm.transfer import Capture, PagedLayers, Restore, encode_and_store

log = logging.getLogger("kvtool.vllm")

STORE_SAMPLE_S = 5.0  # how often worker rank 0 reports what the store's tiers hold


class KvtoolWorker(ConnectorSide):
    """A worker's state: its paged layers, the step's restore and capture, the blocks that failed, the saver."""

    side = "worker"

    def __init__(self, context: ConnectorContext, vllm_config: Any) -> None:
        super().__init__(context)
        self._vllm_config = vllm_config
        self.rank = _tensor_parallel_rank()
        self._dicts = DictionaryKeeper(context.settings.dictionary, context.settings.recipe, self.store, context.facts)
        self._layers: PagedLayers | None = None
        self._overlap = False  # set by register_kv_caches from the settings and the device
        self._restore: Restore | None = None
        self._capture: Capture | None = None
        self._load_errors: set[int] = set()
        self._finished_loads: set[str] = set()  # requests whose (asynchronous) restore completed this step
        self._failed_loads: set[str] = set()  # ... and those of them that failed
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvtool-save")
        self._store_sampled = 0.0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        kv = self.context.kv
        if self.context.refusal is not None:
            log.info("kvtool: no layer registered (%s)", kv.describe())
            return
        head_dim, block_size = self.context.facts.head_dim, self.context.block_size
        names = list(kv_caches)
        tensors = [typed(kv_caches[name], kv.dtype or "") for name in names]
        backends = [_attention_backend(self._vllm_config, name) for name in names]
        orders = [self._tile_orders(name, backend, head_dim, block_size) for name, backend in zip(names, backends)]
        views = [kv_views(t, backend, head_dim, block_size, order) for t, backend, order in zip(tensors, backends, orders)]
        first = tensors[0]
        self._layers = PagedLayers(names, [k for k, _ in views], [v for _, v in views], block_size, first.dtype,
                                   [kv.group_of(name) for name in names])
        overlap = self.context.settings.overlap
        self._overlap = first.device.type != "cpu" if overlap is None else overlap
        tiled = sum(order != (None, None) for order in orders)
        log.info("kvtool: %d layers (%s), paged KV %s %s on %s (backend %s%s), restore %s", len(views), kv.describe(),
                 list(first.shape), first.dtype, first.device, ",".join(sorted(set(backends))),
                 f"; {tiled} layers' blocks reordered from its kernel's tiles" if tiled else "",
                 "overlapped with compute" if self._overlap else "before the forward pass")

    def _tile_orders(self, name: str, backend: str, head_dim: int,
                     block_size: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Where vLLM's CPU kernel puts a block's keys and values (``cpu_tiles``); (None, None) for token rows."""
        if not backend.upper().startswith("CPU"):
            return None, None
        model_dtype, cache_dtype = self._vllm_config.model_config.dtype, self._vllm_config.cache_config.cache_dtype
        isa = getattr(self._vllm_config.compilation_config.static_forward_context.get(name), "isa", None)
        if not isinstance(isa, str):
            isa = attention_isa(model_dtype, block_size, head_dim, cache_dtype)
        return tile_orders(isa, model_dtype, cache_dtype, block_size, head_dim)

    def start_load_kv(self, plan: StepPlan | None) -> None:
        if plan is None or not plan.loads or self._layers is None:
            return
        namer, rank = self.context.namer, self.rank
        self._restore = Restore(self.store, lambda entry_id: namer.key(entry_id, rank), self._layers, plan.loads,
                                self.stats)
        self._restore.start(background=self._overlap)
        if not self._overlap:
            for index in range(len(self._layers.names)):
                self._restore.copy_layer(index)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._restore is not None and self._layers is not None:
            self._restore.copy_layer(self._layers.index(layer_name))

    def save_kv_layer(self, layer_name: str, plan: StepPlan | None) -> None:
        if plan is None or not plan.saves or self._layers is None:
            return
        if self._capture is None or self._capture.jobs is not plan.saves:
            self._capture = Capture(plan.saves, len(self._layers.names))
        self._capture.take_layer(self._layers.index(layer_name), self._layers)

    def wait_for_save(self) -> None:
        failed_requests: set[str] = set()
        if self._restore is not None:
            failed_blocks = self._restore.finish()
            failed_requests = self._restore.failed_requests()
            if self.context.kv.per_request_failures:
                self._finished_loads |= self._restore.request_ids()
                self._failed_loads |= failed_requests
            else:
                self._load_errors |= failed_blocks
            self._restore = None
        if self._capture is not None:
            for entry_id, first_token, keys, values in self._capture.complete_entries(failed_requests):
                self._saver.submit(self._save_entry, entry_id, first_token, keys, values)
            self._capture = None

    def _save_entry(self, entry_id: str, first_token: int, keys: list[np.ndarray], values: list[np.ndarray]) -> None:
        key = self.context.namer.key(entry_id, self.rank)
        start = time.perf_counter()
        try:
            recipe = self._dicts.recipe_for(keys, values)
            stored = encode_and_store(self.store, key, keys, values, recipe, self.context.facts, first_token)
        except Exception:
            log.exception("kvtool: saving entry %s failed", entry_id[:16])
            stored = 0
        self.stats.observe("save_seconds", time.perf_counter() - start)
        if stored:
            self.stats.count("entries_saved")
            self.stats.count("saved_bytes", stored)
            self.stats.count("saved_raw_bytes", sum(a.nbytes for a in keys) + sum(a.nbytes for a in values))
        else:
            self.stats.count("save_failures")
        log.debug("kvtool: entry %s %s", entry_id[:16], "stored" if stored else "not stored")

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous restore completed since the last call, and those of them that failed."""
        finished, failed = self._finished_loads, self._failed_loads
        self._finished_loads, self._failed_loads = set(), set()
        return finished, failed

    def take_stats(self) -> dict[str, Any] | None:
        """As every half's, and every ``STORE_SAMPLE_S`` (rank 0) what the store's tiers hold, sampled off the step."""
        now = time.monotonic()
        if self.rank == 0 and not self._closed and now - self._store_sampled >= STORE_SAMPLE_S:
            self._store_sampled = now  # counting a large store's entries takes a moment: not on the step's path
            self._saver.submit(self._sample_store)
        return super().take_stats()

    def _sample_store(self) -> None:
        try:
            self.stats.sample_store(self.store)
        except Exception:
            log.exception("kvtool: reading the store's stats failed")

    def shutdown(self) -> None:
        if not self._closed:
            self._saver.shutdown(wait=True)
        super().shutdown()

    def _log_summary(self, done: dict[str, Any]) -> None:
        log.info("kvtool at shutdown (worker %d): %d tokens restored, %d restore failures, %d entries saved "
                 "(%.1f MB stored, ratio %s)", self.rank, done["tokens_restored"], done["restore_failures"],
                 done["entries_saved"], done["saved_MB"], done.get("compression_ratio", "-"))


def _tensor_parallel_rank() -> int:
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        rank: int = parallel_state.get_tensor_model_parallel_rank()
        return rank
    return 0


def _attention_backend(vllm_config: Any, layer_name: str) -> str:
    """The name of the attention backend of one layer (its paged layout depends on it)."""
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    get_backend = getattr(layer, "get_attn_backend", None)
    if get_backend is None:
        return "unknown"
    name: str = get_backend().get_name()
    return name
