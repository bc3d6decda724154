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
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

import kvtool
from vllm.v1.kv_offload.base import LookupResult

from kvtool.errors import UsageError
from kvtool.store import open_store
from kvtool.testing.offload import Scheduler, Shape, offload_key, row_bytes, row_source, tiering_spec

ROOT = Path(__file__).resolve().parents[2]
PRIMARY_CHUNKS = 4

# What a user writes: --kv-transfer-config's kv_connector_extra_config (docs/VLLM.md).
EXTRA_CONFIG = """{"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1,
  "secondary_tiers": [{"type": "KvtoolSecondaryTier", "module_path": "kvtool.integrations.vllm_offload",
                       "store": "STORE", "recipe": "RECIPE", "head_dim": 64}]}"""


@pytest.fixture(scope="module")
def sample() -> kvtool.KVCache:
    return kvtool.load(ROOT / "samples" / "code.safetensors")


def make_spec(store: str, recipe: str = "exphuff", layout: str = "LBNHC", groups: int = 1, workers: int = 1):
    tiers = json.loads(EXTRA_CONFIG.replace("STORE", store).replace("RECIPE", recipe))["secondary_tiers"]
    return tiering_spec(Shape(layout=layout, workers=workers), tiers, PRIMARY_CHUNKS, groups=groups)


def chunk_bytes(sample: kvtool.KVCache, n: int, layout: str = "LBNHC", workers: int = 1) -> np.ndarray:
    return row_bytes(sample, n, Shape(layout=layout, workers=workers))


class Engine(Scheduler):
    """vLLM's scheduler and GPU worker over kvtool's tier; each store waits until its chunks are in the store."""

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.tier = self.tiers[0]

    def store(self, keys, chunks, req=None):
        stored = super().store(keys, chunks, req)
        self.tier.wait_stored()
        self.step()
        return stored

    def get(self, key: bytes, size: int) -> np.ndarray | None:
        """The chunk's bytes if vLLM's lookup finds it (promoting it from kvtool's tier), else None."""
        found, data = self.fetch(key, size)
        assert (found is LookupResult.HIT) == (data is not None)
        return data


def fill_and_evict(engine: Engine, sample: kvtool.KVCache, n: int, layout: str = "LBNHC",
                   workers: int = 1) -> tuple[list[bytes], list[np.ndarray]]:
    """Store ``n`` chunks, then as many again: the first ``n`` leave vLLM's CPU tier, kept only by kvtool."""
    keys = [offload_key(i) for i in range(2 * n)]
    chunks = [chunk_bytes(sample, i, layout, workers) for i in range(2 * n)]
    assert engine.store(keys[:n], chunks[:n]) == keys[:n]
    assert engine.store(keys[n:], chunks[n:]) == keys[n:]
    req = engine.request()
    for key in keys[:n]:
        assert engine.primary.lookup(key, req) is LookupResult.MISS
    engine.finish(req)
    return keys, chunks


@pytest.mark.parametrize(("layout", "head_dim", "workers"), [
    ("LBNHC", 64, 1), ("LBHNC", 64, 1), ("LBNHC", None, 1), ("LBNHC", 64, 2),
])
def test_evicted_chunks_come_back_bit_exact_through_promotion(tmp_path, sample, layout, head_dim, workers):
    spec = make_spec(f"file://{tmp_path}/store", layout=layout, workers=workers)
    if head_dim is None:
        spec.secondary_tier_configs[0].pop("head_dim")
    engine = Engine(spec)
    try:
        keys, chunks = fill_and_evict(engine, sample, PRIMARY_CHUNKS, layout, workers)
        assert len(engine.tier.store.keys()) == 2 * PRIMARY_CHUNKS
        for key, chunk in zip(keys[:PRIMARY_CHUNKS], chunks):
            assert np.array_equal(engine.get(key, chunk.size), chunk)
        assert engine.get(offload_key(999), 1) is None
    finally:
        engine.close()


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_with_head_dim_a_stored_chunk_is_the_model_s_keys_and_values(tmp_path, sample, layout):
    engine = Engine(make_spec(f"file://{tmp_path}/store", layout=layout, workers=2))
    try:
        engine.store([offload_key(3)], [chunk_bytes(sample, 3, layout, workers=2)])
        stored = kvtool.decode_cache(engine.tier.store.get(engine.tier.namer.key(offload_key(3))))
    finally:
        engine.close()
    shape = Shape(layout=layout, workers=2)
    assert stored.num_layers == 2 * shape.layers and stored.num_tokens == shape.tokens
    for worker in range(2):
        first_layer, start = row_source(sample, 3, worker, shape)
        expected = sample.select(range(first_layer, first_layer + shape.layers), slice(start, start + shape.tokens))
        for i in range(shape.layers):
            for got, want in ((stored.keys[worker * shape.layers + i], expected.keys[i]),
                              (stored.values[worker * shape.layers + i], expected.values[i])):
                assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_stores_past_the_bound_are_dropped_and_stay_in_vllm_cpu_tier(tmp_path, sample):
    spec = make_spec(f"file://{tmp_path}/store")
    spec.secondary_tier_configs[0]["max_pending_stores"] = 2
    engine = Engine(spec)
    try:
        keys = [offload_key(i) for i in range(3)]
        engine.store(keys, [chunk_bytes(sample, i) for i in range(3)])  # one job of three chunks: one too many
        stored = {engine.tier.namer.key(k) for k in keys[:2]}
        assert engine.tier.stores_dropped == 1 and set(engine.tier.store.keys()) == stored
        req = engine.request()
        assert all(engine.primary.lookup(k, req) is LookupResult.HIT for k in keys)
        engine.finish(req)
        engine.store([offload_key(3)], [chunk_bytes(sample, 3)])  # the first ones are done: room again
        assert len(engine.tier.store.keys()) == 3
    finally:
        engine.close()


def test_a_restarted_manager_finds_the_chunks_in_the_file_store(tmp_path, sample):
    url = f"file://{tmp_path}/store?capacity=64MiB"
    spec = make_spec(url)
    engine = Engine(spec)
    region = spec._scheduler_mmap.mmap_obj
    keys = [offload_key(i) for i in range(PRIMARY_CHUNKS)]
    chunks = [chunk_bytes(sample, i) for i in range(PRIMARY_CHUNKS)]
    try:
        engine.store(keys, chunks)
    finally:
        engine.close()
    assert region.closed  # the tier let go of vLLM's shared region, so vLLM could unmap it
    engine = Engine(make_spec(url))  # a new process's manager: empty CPU tier, same store
    try:
        for key, chunk in zip(keys, chunks):
            assert engine.primary.lookup(key, engine.request()) is LookupResult.MISS
            assert np.array_equal(engine.get(key, chunk.size), chunk)
    finally:
        engine.close()


def test_memory_over_redis_survives_a_restart_in_redis(sample, redis_url):
    """A tiered store: kvtool's memory tier in the scheduler, Redis below it, shared by every server."""
    url = f"memory://?capacity=64MiB,{redis_url}"
    run = os.urandom(16).hex()  # keys of this run only, on a server other runs may share
    spec = make_spec(url)
    spec.secondary_tier_configs[0]["model_id"] = run
    engine = Engine(spec)
    try:
        keys, chunks = fill_and_evict(engine, sample, PRIMARY_CHUNKS)
        engine.tier.store.flush()  # the write-behind copies: what a killed scheduler leaves in Redis
        with open_store(redis_url) as below:
            assert all(below.contains(engine.tier.namer.key(k)) for k in keys)
    finally:
        engine.close()
    spec = make_spec(url)
    spec.secondary_tier_configs[0]["model_id"] = run
    engine = Engine(spec)  # a new memory tier: the chunks come from Redis
    try:
        for key, chunk in zip(keys, chunks):
            assert np.array_equal(engine.get(key, chunk.size), chunk)
    finally:
        engine.close()


def test_a_damaged_entry_is_a_miss_never_wrong_bytes(tmp_path, sample):
    engine = Engine(make_spec(f"file://{tmp_path}/store"))
    try:
        keys, chunks = fill_and_evict(engine, sample, PRIMARY_CHUNKS)
        damaged = keys[1]
        path = next(p for p in (tmp_path / "store" / "entries").rglob("*.kve")
                    if engine.tier.namer.key(damaged).encode() in p.read_bytes())
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x10  # one bit in the encoded chunk
        path.write_bytes(bytes(data))
        assert engine.get(damaged, chunks[1].size) is None  # found in the index, refused by the checksum
        assert engine.primary.lookup(damaged, engine.request()) is LookupResult.MISS
        assert np.array_equal(engine.get(keys[0], chunks[0].size), chunks[0])  # its neighbours still restore
    finally:
        engine.close()


def test_lossy_recipe_restores_within_its_bound(tmp_path, sample):
    bits = 3
    engine = Engine(make_spec("memory://?capacity=64MiB", recipe=f"mant-round:{bits}|byteplane|zstd:3"))
    try:
        keys, chunks = fill_and_evict(engine, sample, PRIMARY_CHUNKS)
        stored = sum(engine.tier.store.info(k).size for k in engine.tier.store.keys())
        assert stored < sum(c.size for c in chunks) / 2
        for key, chunk in zip(keys[:PRIMARY_CHUNKS], chunks):
            restored = engine.get(key, chunk.size).view(sample.dtype.numpy).astype(np.float32)
            original = chunk.view(sample.dtype.numpy).astype(np.float32)
            # round to nearest with `bits` mantissa bits: off by at most half a unit in the last kept place
            assert np.all(np.abs(restored - original) <= np.abs(original) * 2.0 ** -(bits + 1))
            assert not np.array_equal(restored, original)
    finally:
        engine.close()


def test_a_lossy_entry_never_answers_a_lossless_lookup(tmp_path, sample):
    url = f"file://{tmp_path}/store"
    lossy = Engine(make_spec(url, recipe="mant-round:3|byteplane|zstd:3"))
    try:
        lossy.store([offload_key(0)], [chunk_bytes(sample, 0)])
    finally:
        lossy.close()
    lossless = Engine(make_spec(url))
    try:
        assert lossless.get(offload_key(0), 1) is None
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
    spec = make_spec(f"file://{tmp_path}/store", **change)
    spec.secondary_tier_configs[0].update(options)
    spec.secondary_tier_configs[0] = {k: v for k, v in spec.secondary_tier_configs[0].items() if v is not None}
    with pytest.raises(UsageError, match=message) as info:
        spec.get_manager()
    assert "\n" not in str(info.value) and isinstance(info.value, ValueError)  # what vLLM reports as a user's mistake
    assert not os.path.exists(f"/dev/shm/vllm_offload_{spec._engine_id}.mmap")
