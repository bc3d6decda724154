"""kvtool's secondary tier under vLLM's own TieringOffloadingSpec, with vLLM's real classes and no GPU.

vLLM's ``OffloadingSpecFactory`` makes the spec from the JSON a user writes (by its
``spec_name``, as vLLM's ``OffloadingConnector`` does), and the spec builds what a
served engine's scheduler builds: the shared offload region,
``CPUPrimaryTierOffloadingManager``, kvtool's tier through ``SecondaryTierFactory``
(by ``type`` and ``module_path``), ``TieringOffloadingManager``. The tests play the
GPU worker's part (write a chunk's bytes into the primary row vLLM hands out, read
them back from the row vLLM names on a hit) and drive the scheduler's calls: store,
evict by storing more, look up, promote, compare. The chunks hold real KV
(samples/code.safetensors) laid out as vLLM's CUDA backends page it.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

import kvtool
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

from kvtool.errors import UsageError
from kvtool.store import open_store

ROOT = Path(__file__).resolve().parents[2]
LAYERS, BLOCK, BLOCKS_PER_CHUNK = 2, 16, 2
TOKENS = BLOCK * BLOCKS_PER_CHUNK
PRIMARY_CHUNKS = 4
END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())

# What a user writes: --kv-transfer-config's kv_connector_extra_config (docs/VLLM.md).
EXTRA_CONFIG = """{"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": CPU_BYTES,
  "secondary_tiers": [{"type": "KvtoolSecondaryTier", "module_path": "kvtool.integrations.vllm_offload",
                       "store": "STORE", "recipe": "RECIPE", "head_dim": 64}]}"""


@pytest.fixture(scope="module")
def sample() -> kvtool.KVCache:
    return kvtool.load(ROOT / "samples" / "code.safetensors")


def chunk_bytes(sample: kvtool.KVCache, n: int, layout: str = "LBNHC", workers: int = 1) -> np.ndarray:
    """Chunk ``n``'s row as vLLM's workers write it: per worker, per layer, each block's page
    (LBNHC: [tokens, heads, K|V, head_dim]; LBHNC: [heads, tokens, K|V, head_dim])."""
    cells = []
    for worker in range(workers):
        first_layer, start = first_of_chunk(sample, n * workers + worker)
        for layer in range(first_layer, first_layer + LAYERS):
            k = sample.keys[layer][:, start:start + TOKENS]  # [heads, tokens, dim]
            v = sample.values[layer][:, start:start + TOKENS]
            kv = np.stack([k, v], axis=2)  # [heads, tokens, 2, dim]
            if layout == "LBNHC":
                cells.append(kv.transpose(1, 0, 2, 3))
            else:
                heads, _, _, dim = kv.shape
                cells.append(kv.reshape(heads, BLOCKS_PER_CHUNK, BLOCK, 2, dim).transpose(1, 0, 2, 3, 4))
    return np.concatenate([np.ascontiguousarray(c).reshape(-1) for c in cells]).view(np.uint8)


def first_of_chunk(sample: kvtool.KVCache, n: int) -> tuple[int, int]:
    """The first layer and token of the sample that slice ``n`` of chunk data starts at."""
    per_layer_pair = sample.num_tokens // TOKENS
    return LAYERS * (n // per_layer_pair) % sample.num_layers, TOKENS * (n % per_layer_pair)


def make_spec(sample: kvtool.KVCache, store: str, recipe: str = "exphuff", layout: str = "LBNHC",
              groups: int = 1, workers: int = 1) -> TieringOffloadingSpec:
    heads, _, dim = sample.keys[0].shape
    per_block = LAYERS * BLOCK * heads * 2 * dim * sample.dtype.itemsize
    text = (EXTRA_CONFIG.replace("CPU_BYTES", str(PRIMARY_CHUNKS * per_block * BLOCKS_PER_CHUNK * workers))
            .replace("STORE", store).replace("RECIPE", recipe))
    layer_names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
    config = OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(BLOCK, layer_names, g) for g in range(groups)),
        worker_kv_bytes_per_block=per_block,
        enable_kv_cache_events=False,
        extra_config=json.loads(text),
        engine_id=f"kvtool-tier-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name="HuggingFaceTB/SmolLM2-135M-Instruct", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=BLOCKS_PER_CHUNK),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=workers, tp_size=workers, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
            data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=True,
        ),
        kv_cache_layout=layout,
    )
    spec = OffloadingSpecFactory.create_spec(config)  # as vLLM's OffloadingConnector does, by spec_name
    assert isinstance(spec, TieringOffloadingSpec)
    return spec


class Engine:
    """The scheduler's calls on vLLM's manager, and the GPU worker's copies in and out of the primary rows."""

    def __init__(self, spec: TieringOffloadingSpec) -> None:
        self.manager = spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.req = ReqContext(req_id=uuid.uuid4().hex)
        self.manager.on_new_request(self.req)

    def step(self) -> None:
        """End one scheduler step after the tier's jobs have run and its chunks are stored (vLLM polls jobs each
        step; the copies of stored rows are coded and stored behind the jobs)."""
        self.tier.wait_stored()
        self.manager.on_schedule_end(END_OF_STEP)

    def store(self, keys: list[bytes], chunks: list[np.ndarray]) -> list[bytes]:
        """Offload chunks as the GPU worker would; the keys vLLM evicted from its CPU tier to make room."""
        out = self.manager.prepare_store(keys, self.req)
        assert out is not None and out.keys_to_store == keys
        for row, chunk in zip(out.store_spec.chunk_ids, chunks):
            self.rows[int(row), :chunk.size] = chunk
        self.manager.complete_store(keys, self.req)
        self.step()
        return list(out.evicted_keys)

    def lookup(self, key: bytes, steps: int = 20) -> LookupResult:
        """vLLM's lookup, repeated a step at a time while it asks to retry or waits for a promotion."""
        result = self.manager.lookup(key, self.req)
        for _ in range(steps):
            if result not in (LookupResult.RETRY, LookupResult.HIT_PENDING):
                break
            self.step()
            time.sleep(0.01)  # the lookup thread answers between steps
            result = self.manager.lookup(key, self.req)
        return result

    def read(self, key: bytes, size: int) -> np.ndarray:
        """Load a chunk the lookup found, as the GPU worker would: the bytes of the row vLLM names."""
        spec = self.manager.prepare_load([key], self.req)
        data = self.rows[int(spec.chunk_ids[0]), :size].copy()
        self.manager.complete_load([key], self.req)
        return data

    def close(self) -> None:
        self.manager.on_request_finished(self.req)
        self.step()
        del self.rows  # the worker's view of the region, as a worker's ends with it
        self.manager.shutdown()


def offload_key(n: int) -> bytes:
    return make_offload_key(n.to_bytes(4, "big") * 8, 0)


def fill_and_evict(engine: Engine, sample: kvtool.KVCache, n: int, layout: str = "LBNHC",
                   workers: int = 1) -> tuple[list[bytes], list[np.ndarray]]:
    """Store ``n`` chunks, then as many again: the first ``n`` leave vLLM's CPU tier, kept only by kvtool."""
    keys = [offload_key(i) for i in range(2 * n)]
    chunks = [chunk_bytes(sample, i, layout, workers) for i in range(2 * n)]
    engine.store(keys[:n], chunks[:n])
    evicted = engine.store(keys[n:], chunks[n:])
    assert sorted(evicted) == sorted(keys[:n])
    for key in keys[:n]:
        assert engine.manager.primary_tier.lookup(key, engine.req) is LookupResult.MISS
    return keys, chunks


@pytest.mark.parametrize(("layout", "head_dim", "workers"), [
    ("LBNHC", 64, 1), ("LBHNC", 64, 1), ("LBNHC", None, 1), ("LBNHC", 64, 2),
])
def test_evicted_chunks_come_back_bit_exact_through_promotion(tmp_path, sample, layout, head_dim, workers):
    spec = make_spec(sample, f"file://{tmp_path}/store", layout=layout, workers=workers)
    if head_dim is None:
        spec.secondary_tier_configs[0].pop("head_dim")
    engine = Engine(spec)
    try:
        keys, chunks = fill_and_evict(engine, sample, PRIMARY_CHUNKS, layout, workers)
        assert len(engine.tier.store.keys()) == 2 * PRIMARY_CHUNKS
        for key, chunk in zip(keys[:PRIMARY_CHUNKS], chunks):
            assert engine.lookup(key) is LookupResult.HIT
            assert np.array_equal(engine.read(key, chunk.size), chunk)
        assert engine.lookup(offload_key(999)) is LookupResult.MISS
    finally:
        engine.close()


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_with_head_dim_a_stored_chunk_is_the_model_s_keys_and_values(tmp_path, sample, layout):
    engine = Engine(make_spec(sample, f"file://{tmp_path}/store", layout=layout, workers=2))
    try:
        engine.store([offload_key(3)], [chunk_bytes(sample, 3, layout, workers=2)])
        stored = kvtool.decode_cache(engine.tier.store.get(engine.tier.namer.key(offload_key(3))))
    finally:
        engine.close()
    assert stored.num_layers == 2 * LAYERS and stored.num_tokens == TOKENS
    for worker in range(2):
        first_layer, start = first_of_chunk(sample, 3 * 2 + worker)
        expected = sample.select(range(first_layer, first_layer + LAYERS), slice(start, start + TOKENS))
        for i in range(LAYERS):
            for got, want in ((stored.keys[worker * LAYERS + i], expected.keys[i]),
                              (stored.values[worker * LAYERS + i], expected.values[i])):
                assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_stores_past_the_bound_are_dropped_and_stay_in_vllm_cpu_tier(tmp_path, sample):
    spec = make_spec(sample, f"file://{tmp_path}/store")
    spec.secondary_tier_configs[0]["max_pending_stores"] = 2
    engine = Engine(spec)
    try:
        keys = [offload_key(i) for i in range(3)]
        engine.store(keys, [chunk_bytes(sample, i) for i in range(3)])  # one job of three chunks: one too many
        stored = {engine.tier.namer.key(k) for k in keys[:2]}
        assert engine.tier.stores_dropped == 1 and set(engine.tier.store.keys()) == stored
        assert all(engine.manager.primary_tier.lookup(k, engine.req) is LookupResult.HIT for k in keys)
        engine.store([offload_key(3)], [chunk_bytes(sample, 3)])  # the first ones are done: room again
        assert len(engine.tier.store.keys()) == 3
    finally:
        engine.close()


def test_a_restarted_manager_finds_the_chunks_in_the_file_store(tmp_path, sample):
    url = f"file://{tmp_path}/store?capacity=64MiB"
    spec = make_spec(sample, url)
    engine = Engine(spec)
    region = spec._scheduler_mmap.mmap_obj
    keys = [offload_key(i) for i in range(PRIMARY_CHUNKS)]
    chunks = [chunk_bytes(sample, i) for i in range(PRIMARY_CHUNKS)]
    try:
        engine.store(keys, chunks)
    finally:
        engine.close()
    assert region.closed  # the tier let go of vLLM's shared region, so vLLM could unmap it
    engine = Engine(make_spec(sample, url))  # a new process's manager: empty CPU tier, same store
    try:
        for key, chunk in zip(keys, chunks):
            assert engine.manager.primary_tier.lookup(key, engine.req) is LookupResult.MISS
            assert engine.lookup(key) is LookupResult.HIT
            assert np.array_equal(engine.read(key, chunk.size), chunk)
    finally:
        engine.close()


def test_memory_over_redis_survives_a_restart_in_redis(sample, redis_url):
    """A tiered store: kvtool's memory tier in the scheduler, Redis below it, shared by every server."""
    url = f"memory://?capacity=64MiB,{redis_url}"
    run = uuid.uuid4().hex  # keys of this run only, on a server other runs may share
    spec = make_spec(sample, url)
    spec.secondary_tier_configs[0]["model_id"] = run
    engine = Engine(spec)
    try:
        keys, chunks = fill_and_evict(engine, sample, PRIMARY_CHUNKS)
        engine.tier.store.flush()  # the write-behind copies: what a killed scheduler leaves in Redis
        with open_store(redis_url) as below:
            assert all(below.contains(engine.tier.namer.key(k)) for k in keys)
    finally:
        engine.close()
    spec = make_spec(sample, url)
    spec.secondary_tier_configs[0]["model_id"] = run
    engine = Engine(spec)  # a new memory tier: the chunks come from Redis
    try:
        for key, chunk in zip(keys, chunks):
            assert engine.lookup(key) is LookupResult.HIT
            assert np.array_equal(engine.read(key, chunk.size), chunk)
    finally:
        engine.close()


def test_a_damaged_entry_is_a_miss_never_wrong_bytes(tmp_path, sample):
    engine = Engine(make_spec(sample, f"file://{tmp_path}/store"))
    try:
        keys, chunks = fill_and_evict(engine, sample, PRIMARY_CHUNKS)
        damaged = keys[1]
        path = next(p for p in (tmp_path / "store" / "entries").rglob("*.kve")
                    if engine.tier.namer.key(damaged).encode() in p.read_bytes())
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x10  # one bit in the encoded chunk
        path.write_bytes(bytes(data))
        assert engine.lookup(damaged) is LookupResult.MISS  # found in the index, refused by the checksum
        assert engine.manager.primary_tier.lookup(damaged, engine.req) is LookupResult.MISS
        assert engine.lookup(keys[0]) is LookupResult.HIT  # its neighbours still restore
        assert np.array_equal(engine.read(keys[0], chunks[0].size), chunks[0])
    finally:
        engine.close()


def test_lossy_recipe_restores_within_its_bound(tmp_path, sample):
    bits = 3
    engine = Engine(make_spec(sample, "memory://?capacity=64MiB", recipe=f"mant-round:{bits}|byteplane|zstd:3"))
    try:
        keys, chunks = fill_and_evict(engine, sample, PRIMARY_CHUNKS)
        stored = sum(engine.tier.store.info(k).size for k in engine.tier.store.keys())
        assert stored < sum(c.size for c in chunks) / 2
        for key, chunk in zip(keys[:PRIMARY_CHUNKS], chunks):
            assert engine.lookup(key) is LookupResult.HIT
            restored = engine.read(key, chunk.size).view(sample.dtype.numpy).astype(np.float32)
            original = chunk.view(sample.dtype.numpy).astype(np.float32)
            # round to nearest with `bits` mantissa bits: off by at most half a unit in the last kept place
            assert np.all(np.abs(restored - original) <= np.abs(original) * 2.0 ** -(bits + 1))
            assert not np.array_equal(restored, original)
    finally:
        engine.close()


def test_a_lossy_entry_never_answers_a_lossless_lookup(tmp_path, sample):
    url = f"file://{tmp_path}/store"
    lossy = Engine(make_spec(sample, url, recipe="mant-round:3|byteplane|zstd:3"))
    try:
        lossy.store([offload_key(0)], [chunk_bytes(sample, 0)])
    finally:
        lossy.close()
    lossless = Engine(make_spec(sample, url))
    try:
        assert lossless.lookup(offload_key(0)) is LookupResult.MISS
    finally:
        lossless.close()


@pytest.mark.parametrize(("change", "message"), [
    ({"layout": "BLNHC"}, "KV cache layout 'BLNHC' is not supported"),
    ({"layout": "LBHNC", "options": {"head_dim": None}}, "needs the model's head_dim"),
    ({"groups": 2}, "2 KV cache groups"),
    ({"options": {"store": None}}, '"store" .* is required'),
    ({"options": {"recipe": "ctxans:nosuch.kvd"}}, "nosuch"),
    ({"options": {"workers": 0}}, "workers must be an integer of at least 1"),
    ({"options": {"locality": "MOON"}}, "locality must be LOCAL or REMOTE"),
])
def test_layouts_it_does_not_understand_stop_startup_with_one_line(tmp_path, sample, change, message):
    change = dict(change)
    options = change.pop("options", {})
    spec = make_spec(sample, f"file://{tmp_path}/store", **change)
    spec.secondary_tier_configs[0].update(options)
    spec.secondary_tier_configs[0] = {k: v for k, v in spec.secondary_tier_configs[0].items() if v is not None}
    with pytest.raises(UsageError, match=message) as info:
        spec.get_manager()
    assert "\n" not in str(info.value)
    assert not os.path.exists(f"/dev/shm/vllm_offload_{spec._engine_id}.mmap")
