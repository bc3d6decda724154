"""What both halves of the connector derive from vLLM's configuration, and what each half shares in shape.

The scheduler half and the worker half are built from one ``ConnectorContext``
(settings, the entry namer, the model's KV facts and KV cache groups, and why
kvtool restores nothing for the model, if it does not), each opens the process's
store for the configured URL, and each counts what it does into its own
``StatsCollector`` and logs its totals once, at shutdown or on the signal that
ends the process. Nothing here imports vLLM or torch: vLLM's config objects are
read by attribute.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

from kvtool.cache import ModelFacts
from kvtool.errors import UsageError
from kvtool.integrations.vllm import shared_store
from kvtool.integrations.vllm.kv_groups import ModelKV
from kvtool.integrations.vllm.settings import ConnectorSettings
from kvtool.integrations.vllm.stats import StatsCollector, empty, merge, summary
from kvtool.recipe import Recipe
from kvtool.store import Store
from kvtool.entries import recipe_problem
from kvtool.entries.names import EntryNamer

log = logging.getLogger("kvtool.vllm")

# Hash functions whose block hashes vLLM seeds per process unless PYTHONHASHSEED is set.
_REPRODUCIBLE_HASHES = ("sha256", "sha256_cbor")


@dataclass(frozen=True)
class ConnectorContext:
    """The connector's settings and what they mean for this model and this vLLM configuration."""

    settings: ConnectorSettings
    block_size: int
    blocks_per_entry: int
    namer: EntryNamer
    facts: ModelFacts
    executor: Any  # vLLM's distributed_executor_backend ("uni": scheduler and workers in one process)
    kv: ModelKV
    refusal: str | None = None  # why kvtool restores nothing for this model: it then claims and saves nothing

    @classmethod
    def from_vllm(cls, vllm_config: Any, extra: Mapping[str, Any] | None, kv_cache_config: Any = None) -> "ConnectorContext":
        """``kv_cache_config``: the ``KVCacheConfig`` vLLM hands every connector (its KV cache groups)."""
        settings = ConnectorSettings.from_extra_config(extra)
        cache, model, parallel = vllm_config.cache_config, vllm_config.model_config, vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise UsageError("the kvtool connector does not support pipeline parallelism yet")
        kv_dtype = str(model.dtype) if cache.cache_dtype == "auto" else str(cache.cache_dtype)
        namer = EntryNamer(
            settings.model_id or str(model.model),
            Recipe.parse(settings.recipe).spec(),
            kv_dtype,
            cache.block_size,
            parallel.tensor_parallel_size,
        )
        facts = ModelFacts(
            model_id=namer.model_id,
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
        kv = ModelKV.from_vllm(vllm_config, kv_cache_config)
        refusal = kv.refusal
        if refusal is None and kv.dtype is not None:
            problem = recipe_problem(namer.recipe, kv.dtype, facts.num_kv_heads, facts.head_dim)
            if problem is not None:
                raise UsageError(f"{problem}; choose another recipe for this KV cache")
        return cls(settings, cache.block_size, settings.blocks_per_entry(cache.block_size), namer, facts,
                   parallel.distributed_executor_backend, kv, refusal)


class ConnectorSide(ABC):
    """One half of the connector: the store it opened, what it counted, its totals for the shutdown line."""

    side = "connector"

    def __init__(self, context: ConnectorContext) -> None:
        self.context = context
        self.store = _open_store(context, self.side)
        self.stats = StatsCollector()
        self._totals: dict[str, Any] = empty()
        self._totals_logged = False
        self._closed = False

    def take_stats(self) -> dict[str, Any] | None:
        """What this half counted since the last call (None if nothing), added to its totals."""
        data = self.stats.take()
        if data is not None:
            merge(self._totals, data)
        return data

    def log_totals(self) -> None:
        """This half's totals, once: at shutdown, or when the signal that ends the process arrives."""
        if self._totals_logged:
            return
        self._totals_logged = True
        self._log_summary(summary(self._totals))

    @abstractmethod
    def _log_summary(self, done: dict[str, Any]) -> None:
        """Log this half's totals (``done``) in its own words."""

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.take_stats()
        self.log_totals()
        shared_store.release(self.context.settings.store)


def _open_store(context: ConnectorContext, side: str) -> Store:
    """The store both halves use; a store with no tier other processes reach needs them in one process."""
    url = context.settings.store
    store = shared_store.acquire(url, context.settings.write_behind)
    if context.executor != "uni" and not store.shared:
        shared_store.release(url)
        raise UsageError(
            f"store {store.describe()} lives in one process, but vLLM runs its scheduler and workers in "
            "separate processes here: add a tier they share, e.g. "
            f"'{url},file:///var/cache/kvtool' (or redis://), or run vLLM in one process"
        )
    recipe = context.namer.recipe
    lossy = " (lossy: restored prefixes are approximations)" if Recipe.parse(recipe).lossy else ""
    log.info("kvtool store %s (%s side), recipe %s%s, %d blocks per entry", store.describe(), side, recipe, lossy,
             context.blocks_per_entry)
    return store
