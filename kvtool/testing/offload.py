"""vLLM's side of a secondary offload tier, with vLLM's real classes and no GPU: for tests and the tier's torture.

``tiering_spec`` makes the ``TieringOffloadingSpec`` a served engine's scheduler
makes from ``kv_connector_extra_config`` (by ``spec_name``, through vLLM's
``OffloadingSpecFactory``), for a model of a given shape and parallel layout;
its manager builds the shared offload region, vLLM's CPU primary tier and the
secondary tiers named (kvtool's, vLLM's own ``fs``) through vLLM's factory.
``Scheduler`` makes the calls vLLM's scheduler makes on that manager, and plays
the GPU worker's part: it writes a chunk's bytes into the primary row vLLM
hands out for a store, and reads them from the row vLLM names for a load.
``row_bytes`` lays real KV out as vLLM's workers page it.

Importing this module imports vLLM (its environment: scripts/vllm-env.sh).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtool.cache import KVCache

END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
#: How long a lookup that vLLM answers RETRY or HIT_PENDING is repeated, and the pause between steps: the tiers'
#: lookup threads and jobs run between them, later on a busy machine.
PATIENCE_S, STEP_PAUSE_S = 60.0, 0.005


def until(done: Callable[[], bool], between: Callable[[], None], seconds: float = PATIENCE_S) -> bool:
    """Call ``between`` (a scheduler step) until ``done()``; False if it still is not after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            return False
        between()
        time.sleep(STEP_PAUSE_S)
    return True


@dataclass(frozen=True)
class Shape:
    """What an offload row holds: ``layers`` layers of ``blocks_per_chunk`` blocks of ``block`` tokens of ``heads``
    KV heads of ``head_dim`` (per worker), in vLLM's ``layout``; ``workers`` cells, or one when ``replicated``."""

    layers: int = 2
    block: int = 16
    blocks_per_chunk: int = 2
    heads: int = 3
    head_dim: int = 64
    layout: str = "LBNHC"
    workers: int = 1
    replicated: bool = False
    dtype: str = "bfloat16"

    @property
    def tokens(self) -> int:
        return self.block * self.blocks_per_chunk

    @property
    def bytes_per_block(self) -> int:
        """One worker's bytes of one block over every layer (2 bytes an element)."""
        return self.layers * self.block * self.heads * 2 * self.head_dim * 2

    @property
    def copies(self) -> int:
        return 1 if self.replicated else self.workers

    @property
    def chunk_bytes(self) -> int:
        return self.copies * self.blocks_per_chunk * self.bytes_per_block


def tiering_spec(shape: Shape, tiers: list[dict[str, Any]], primary_chunks: int,
                 model: str = "HuggingFaceTB/SmolLM2-135M-Instruct", groups: int = 1) -> TieringOffloadingSpec:
    """The spec vLLM's ``OffloadingConnector`` makes for this model shape, a CPU tier of ``primary_chunks`` chunks and
    the secondary tiers ``tiers`` (each a ``secondary_tiers`` entry of ``kv_connector_extra_config``); ``groups``
    KV cache groups alike (hybrid attention)."""
    layer_names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(shape.layers))
    config = OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(shape.block, layer_names, g) for g in range(groups)),
        worker_kv_bytes_per_block=shape.bytes_per_block,
        enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": primary_chunks * shape.chunk_bytes,
                      "secondary_tiers": [dict(t) for t in tiers]},
        engine_id=f"kvtool-tier-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype=shape.dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=shape.block, blocks_per_chunk=shape.blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=shape.workers, tp_size=shape.workers, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=not shape.replicated,
        ),
        replicated_layout=shape.replicated,
        kv_cache_layout=shape.layout,
    )
    spec = OffloadingSpecFactory.create_spec(config)
    assert isinstance(spec, TieringOffloadingSpec)
    return spec


def kvtool_tier(store: str, **options: Any) -> dict[str, Any]:
    """kvtool's tier as a ``secondary_tiers`` entry (docs/VLLM.md), keys and values cut at the shape's head size."""
    return {"type": "KvtoolSecondaryTier", "module_path": "kvtool.integrations.vllm_offload", "store": store,
            "head_dim": Shape.head_dim, **options}


def vllm_file_tier(root: str) -> dict[str, Any]:
    """vLLM's own file tier (``fs``): one file a chunk, the row's bytes as they are."""
    return {"type": "fs", "root_dir": root, "n_read_threads": 2, "n_write_threads": 2}


def offload_key(n: int) -> bytes:
    """vLLM's offload key of a chunk named ``n`` (block hash + KV cache group 0)."""
    return make_offload_key(n.to_bytes(4, "big") * 8, 0)


def row_bytes(sample: KVCache, n: int, shape: Shape) -> np.ndarray:
    """Chunk ``n``'s row as vLLM's workers write it: per worker cell, per layer, each block's page (LBNHC:
    ``[tokens, heads, K|V, head_dim]``; LBHNC: ``[heads, tokens, K|V, head_dim]``), cut from the sample's real KV."""
    cells = []
    for worker in range(shape.copies):
        first_layer, start = row_source(sample, n, worker, shape)
        for layer in range(first_layer, first_layer + shape.layers):
            k = sample.keys[layer][:shape.heads, start:start + shape.tokens, :shape.head_dim]
            v = sample.values[layer][:shape.heads, start:start + shape.tokens, :shape.head_dim]
            kv = np.stack([k, v], axis=2)  # [heads, tokens, 2, dim]
            if shape.layout == "LBNHC":
                cells.append(kv.transpose(1, 0, 2, 3))
            else:
                heads, _, _, dim = kv.shape
                cells.append(kv.reshape(heads, shape.blocks_per_chunk, shape.block, 2, dim).transpose(1, 0, 2, 3, 4))
    return np.concatenate([np.ascontiguousarray(c).reshape(-1) for c in cells]).view(np.uint8)


def row_source(sample: KVCache, n: int, worker: int, shape: Shape) -> tuple[int, int]:
    """The first layer and token of the sample that worker cell ``worker`` of chunk ``n``'s row is cut from."""
    slice_n = n * shape.copies + worker
    per_pair = sample.num_tokens // shape.tokens
    return shape.layers * (slice_n // per_pair) % (sample.num_layers - shape.layers + 1), \
        shape.tokens * (slice_n % per_pair)


class Scheduler:
    """The scheduler's calls on vLLM's tiering manager, and the GPU worker's copies in and out of its primary rows."""

    def __init__(self, spec: TieringOffloadingSpec) -> None:
        self.manager = spec.get_manager()
        self.primary = self.manager.primary_tier
        self.tiers = self.manager.secondary_tiers
        self.rows = np.asarray(self.primary.get_kv_memoryview()).view(np.uint8)

    def step(self) -> None:
        """End one scheduler step: vLLM polls the tiers' finished jobs and flushes lookups and promotions."""
        self.manager.on_schedule_end(END_OF_STEP)

    def request(self) -> ReqContext:
        req = ReqContext(req_id=uuid.uuid4().hex)
        self.manager.on_new_request(req)
        return req

    def finish(self, req: ReqContext) -> None:
        self.manager.on_request_finished(req)

    def store(self, keys: Sequence[bytes], chunks: Sequence[np.ndarray], req: ReqContext | None = None) -> list[bytes]:
        """Offload chunks as the GPU worker would (those vLLM's CPU tier does not hold yet); the keys it stored, or
        none when it had no room (its rows all in use)."""
        own = req is None
        req = req or self.request()
        try:
            out = self.manager.prepare_store(list(keys), req)
            if out is None or not out.keys_to_store:  # no room, or vLLM's CPU tier holds them all
                return []
            by_key = dict(zip(keys, chunks))
            for key, row in zip(out.keys_to_store, out.store_spec.chunk_ids):
                chunk = by_key[key]
                self.rows[int(row), :chunk.size] = chunk
            self.manager.complete_store(out.keys_to_store, req)
            return list(out.keys_to_store)
        finally:
            if own:
                self.finish(req)
            self.step()

    def lookup(self, key: bytes, req: ReqContext) -> LookupResult:
        """vLLM's lookup, repeated a step at a time while it asks to retry or waits for a promotion."""
        result = [self.manager.lookup(key, req)]

        def answered() -> bool:
            if result[0] in (LookupResult.RETRY, LookupResult.HIT_PENDING):
                result[0] = self.manager.lookup(key, req)
            return result[0] not in (LookupResult.RETRY, LookupResult.HIT_PENDING)

        until(answered, self.step)
        return result[0]

    def read(self, key: bytes, size: int, req: ReqContext) -> np.ndarray:
        """Load a chunk the lookup found, as the GPU worker would: the bytes of the row vLLM names."""
        spec = self.manager.prepare_load([key], req)
        data = self.rows[int(spec.chunk_ids[0]), :size].copy()
        self.manager.complete_load([key], req)
        return data

    def fetch(self, key: bytes, size: int) -> tuple[LookupResult, np.ndarray | None]:
        """Look a chunk up in a request of its own and, on a hit, read it."""
        req = self.request()
        try:
            found = self.lookup(key, req)
            return found, self.read(key, size, req) if found is LookupResult.HIT else None
        finally:
            self.finish(req)
            self.step()

    def settle(self) -> None:
        """Step until no tier has a job running (vLLM collects every result)."""
        for tier in self.tiers:
            tier.drain_jobs()
        if not until(lambda: not self.manager.has_pending_work(), self.step):
            raise TimeoutError("vLLM's tiering manager still has work pending")

    def close(self) -> None:
        self.settle()
        del self.rows  # the worker's view of the region, as a worker's ends with it
        self.manager.shutdown()
