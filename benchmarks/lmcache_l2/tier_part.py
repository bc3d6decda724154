"""The tier part: chunks stored into and loaded from a secondary tier of vLLM's own offloading, per chunk.

vLLM's ``TieringOffloadingSpec`` is made by vLLM's own factory from the JSON a user
writes (as ``tests/vllm_e2e/test_vllm_offload_tier.py`` does; its classes import on
a CPU), with one secondary tier: kvtool's (``kvtool.integrations.vllm_offload``,
with a recipe) or vLLM's own ``fs`` tier, which writes a chunk's raw bytes. The chunks
are the SmolLM2 samples as vLLM's CUDA backends page them (``LBNHC``: per layer, each
token's heads' keys then values; 30 layers x 256 tokens, 5.9 MB a chunk), written into
the primary tier's rows as the GPU worker would. One store job of all the chunks, then
(page cache dropped in the cold cell) one load job of them into zeroed rows, each
timed from submit to the tier reporting it finished; the loaded rows are compared
with the originals bit for bit.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np

import kvtool
from cells import TIERS, Place
from chunk_part import timing_row
from pagecache import drop, files, resident_bytes

ROOT = Path(__file__).resolve().parents[2]
BLOCK, BLOCKS_PER_CHUNK = 16, 16
TOKENS = BLOCK * BLOCKS_PER_CHUNK


def chunk_row(cache: kvtool.KVCache) -> np.ndarray:
    """The cache's first 256 tokens of every layer as one LBNHC offload row (bytes)."""
    pages = [np.stack([k[:, :TOKENS], v[:, :TOKENS]], axis=2).transpose(1, 0, 2, 3)  # [tokens, heads, K|V, dim]
             for k, v in zip(cache.keys, cache.values)]
    return np.concatenate([np.ascontiguousarray(p).reshape(-1) for p in pages]).view(np.uint8)


def tier_entry(name: str, place: Place) -> dict[str, Any]:
    recipe, _ = TIERS[name]
    if recipe is None:
        return {"type": "fs", "root_dir": str(place.folder)}
    return {"type": "KvtoolSecondaryTier", "module_path": "kvtool.integrations.vllm_offload",
            "store": place.store_url(), "recipe": recipe, "head_dim": 64}


def make_spec(entry: dict[str, Any], cache: kvtool.KVCache, chunks: int) -> Any:
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    heads, _, dim = cache.keys[0].shape
    per_block = cache.num_layers * BLOCK * heads * 2 * dim * cache.dtype.itemsize
    layer_names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(cache.num_layers))
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(BLOCK, layer_names, 0),), worker_kv_bytes_per_block=per_block,
        enable_kv_cache_events=False, engine_id=f"kvtool-l2-bench-{uuid.uuid4().hex[:12]}",
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": chunks * per_block * BLOCKS_PER_CHUNK,
                      "secondary_tiers": [entry]},
        model=OffloadingModelConfig(name="HuggingFaceTB/SmolLM2-135M-Instruct", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=BLOCKS_PER_CHUNK),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=True),
        kv_cache_layout="LBNHC",
    )
    return OffloadingSpecFactory.create_spec(config)


def _job(tier: Any, submit: Callable[[Any], None], job: Any) -> tuple[float, float, bool]:
    """Submit a job and wait for its result: wall and process CPU seconds, and whether it succeeded."""
    cpu, wall = time.process_time(), time.perf_counter()
    submit(job)
    while True:
        done = [r for r in tier.get_finished_jobs() if r.job_id == job.job_id]
        if done:
            return time.perf_counter() - wall, time.process_time() - cpu, done[0].success
        time.sleep(0.002)


def run(names: tuple[str, ...], repeats: int, chunks: int, cold: bool, place_of: Callable[[str], Place],
        label: str = "") -> list[dict[str, Any]]:
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob

    samples = [kvtool.load(ROOT / "samples" / f"{s}.safetensors") for s in ("code", "prose")]
    data = [chunk_row(samples[i % 2]) for i in range(chunks)]
    raw = sum(d.size for d in data)
    rows = []
    for repeat in range(repeats):  # the configurations alternate, so that the machine's load swings hit all
        for name in names:
            place = place_of(f"tier-{name}{label}-{repeat}")
            spec = make_spec(tier_entry(name, place), samples[0], chunks)
            manager = spec.get_manager()
            tier = manager.secondary_tiers[0]
            region = np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)
            req = ReqContext(req_id=uuid.uuid4().hex)
            keys = [make_offload_key(uuid.uuid4().bytes * 2, 0) for _ in range(chunks)]
            ids = np.arange(chunks, dtype=np.int64)
            try:
                for i, d in enumerate(data):
                    region[i, :d.size] = d
                store_wall, store_cpu, stored = _job(tier, tier.submit_store, TransferJob(1, keys, ids, False, req))
                held = _held(tier, place)
                resident = None
                if cold and place.folder is not None:
                    drop(place.folder)
                    resident = resident_bytes(place.folder)
                region[:chunks] = 0
                load_wall, load_cpu, loaded = _job(tier, tier.submit_load, TransferJob(2, keys, ids, True, req))
                exact = loaded and all(np.array_equal(region[i, :d.size], d) for i, d in enumerate(data))
            finally:
                del region
                manager.shutdown()
            rows.append(timing_row("tier", name + label, repeat, chunks, raw, held, (store_cpu, store_wall),
                                   (load_cpu, load_wall), resident_at_load=resident, stored=stored,
                                   workers=_workers(tier), bit_exact=bool(exact)))
            print(f"tier {name}{label} #{repeat}: {json.dumps(rows[-1])}", flush=True)
    return rows


def _held(tier: Any, place: Place) -> int:
    """Bytes the tier keeps: its store's entries (kvtool), else the folder's files (vLLM's fs tier)."""
    store = getattr(tier, "store", None)
    if store is not None:
        return sum(store.info(key).size for key in store.keys())
    return sum(p.stat().st_size for p in files(place.folder)) if place.folder else 0


def _workers(tier: Any) -> int | None:
    pool = getattr(tier, "_pool", None)
    return getattr(pool, "_max_workers", None)
