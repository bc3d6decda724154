"""What vLLM 0.32's tiering manager relies on from a secondary tier, held against kvtool's tier, one obligation a test.

    .venv-vllm/bin/python -m pytest tests/vllm_e2e/test_tier_contract.py

Written from vLLM's interface (``SecondaryTierManager`` in vllm/v1/kv_offload/
tiering/base.py, ``AsyncLookupManager``) and from how ``TieringOffloadingManager``
uses it: lookups that never block and answer RETRY until the answer is in; a
load job that reports exactly the chunks it restored (``successful_keys``), the
others looked up as misses from then on; every job reported once, in whatever
order jobs finish, all of them by the time ``drain_jobs`` returns; the primary
tier's rows free for vLLM to evict and reuse once a store job is reported, what
the tier stores unchanged by that; each chunk of a job stored or restored on its
own; the keys of tensor-parallel layouts (one copy shared by every TP size, a
sharded row by none); ``reset_cache`` and ``shutdown`` with work in flight.
vLLM's real manager, CPU tier and factory run here; the tests play the GPU worker.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

import kvtool  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult  # noqa: E402

import kvtool.integrations.vllm_offload.tier as tier_module  # noqa: E402
from kvtool.store import open_store  # noqa: E402
from kvtool.testing.offload import (  # noqa: E402
    END_OF_STEP,
    Scheduler,
    until,
    Shape,
    kvtool_tier,
    offload_key,
    row_bytes,
    tiering_spec,
)

ROOT = Path(__file__).resolve().parents[2]
PRIMARY = 4
SHAPE = Shape()


@pytest.fixture(scope="module")
def sample() -> kvtool.KVCache:
    return kvtool.load(ROOT / "samples" / "code.safetensors")


class Recorded(Scheduler):
    """A scheduler over kvtool's tier alone that records every job result the tier hands vLLM."""

    def __init__(self, store: str, shape: Shape = SHAPE, primary: int = PRIMARY, **options) -> None:
        super().__init__(tiering_spec(shape, [kvtool_tier(store, **options)], primary))
        self.shape = shape
        self.tier = self.tiers[0]
        self.results: list = []
        handed = self.tier.get_finished_jobs

        def recording():
            results = list(handed())
            self.results.extend(results)
            return results

        self.tier.get_finished_jobs = recording

    def chunk(self, sample, n: int) -> np.ndarray:
        return row_bytes(sample, n, self.shape)

    def stored(self, key: bytes) -> bool:
        return self.tier.store.contains(self.tier.namer.key(key))


def promoting(engine: Recorded, keys: list[bytes], req) -> bool:
    """Look ``keys`` up until vLLM has queued each one's promotion from the tier (HIT_PENDING), stepping the tier's
    lookups only, so that the promotions wait for the scheduler's next step and go to the tier as one load job."""
    return until(lambda: all(engine.manager.lookup(k, req) is LookupResult.HIT_PENDING for k in keys),
                 lambda: engine.tier.on_schedule_end(END_OF_STEP))


@pytest.fixture
def engine(tmp_path):
    made = Recorded(f"file://{tmp_path}/store")
    yield made
    made.close()


def test_a_lookup_never_blocks_and_answers_retry_until_the_store_has(engine, sample):
    engine.store([offload_key(1)], [engine.chunk(sample, 1)])
    engine.tier.wait_stored()
    asked, answer = threading.Event(), threading.Event()
    contains_many = engine.tier.store.contains_many

    def slow(keys):
        asked.set()
        answer.wait(30)
        return contains_many(keys)

    engine.tier.store.contains_many = slow
    req = engine.request()
    results = [engine.tier.lookup(offload_key(1), req)]
    engine.tier.on_schedule_end(END_OF_STEP)  # vLLM flushes this step's lookups to the lookup thread
    assert asked.wait(30)
    results.append(engine.tier.lookup(offload_key(1), req))  # the store has not answered: no wait here
    answer.set()
    assert until(lambda: engine.tier.lookup(offload_key(1), req) is not LookupResult.RETRY,
                 lambda: engine.tier.on_schedule_end(END_OF_STEP))
    assert results == [LookupResult.RETRY, LookupResult.RETRY]
    assert engine.tier.lookup(offload_key(1), req) is LookupResult.HIT
    assert engine.tier.lookup(offload_key(2), req) is LookupResult.RETRY
    engine.finish(req)


def test_a_load_job_reports_exactly_the_chunks_it_restored(engine, sample):
    keys = [offload_key(i) for i in range(3)]
    chunks = [engine.chunk(sample, i) for i in range(3)]
    engine.store(keys, chunks)
    engine.settle()  # their rows free again: the next store evicts them
    engine.store([offload_key(10 + i) for i in range(PRIMARY)], [engine.chunk(sample, 10 + i) for i in range(PRIMARY)])
    engine.settle()
    engine.tier.wait_stored()  # the three left vLLM's CPU tier: only kvtool holds them
    req = engine.request()
    # vLLM's lookups until each is a hit in kvtool's tier (its promotion queued); only the tier's lookups are
    # flushed between them: the promotions wait for the scheduler's step
    assert promoting(engine, keys, req)
    engine.tier.store.delete(engine.tier.namer.key(keys[1]))  # gone before the load job runs
    engine.step()  # the three promotions go to the tier as one load job
    engine.tier.drain_jobs()
    engine.step()
    (job,) = [r for r in engine.results if r.successful_keys is not None or not r.success]
    assert not job.success and set(job.successful_keys) == {keys[0], keys[2]}
    assert [engine.manager.lookup(k, req) for k in keys] == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
    assert np.array_equal(engine.read(keys[0], chunks[0].size, req), chunks[0])
    assert np.array_equal(engine.read(keys[2], chunks[2].size, req), chunks[2])
    assert engine.tier.lookup(keys[1], req) is LookupResult.MISS  # a failed chunk is a miss from then on
    engine.finish(req)


def test_every_job_is_reported_once_as_it_finishes_and_drain_waits_for_all(engine, sample, monkeypatch):
    engine.store([offload_key(i) for i in range(3)], [engine.chunk(sample, i) for i in range(3)])
    engine.settle()  # their rows free again: the next store evicts them
    engine.store([offload_key(10 + i) for i in range(PRIMARY)], [engine.chunk(sample, 10 + i) for i in range(PRIMARY)])
    engine.settle()
    engine.tier.wait_stored()
    req = engine.request()
    assert engine.primary.lookup(offload_key(0), req) is LookupResult.MISS  # only kvtool holds it
    engine.finish(req)
    engine.results.clear()
    release = threading.Event()
    load_row = tier_module.load_row

    def held(*args):
        release.wait(30)
        return load_row(*args)

    monkeypatch.setattr(tier_module, "load_row", held)
    req = engine.request()
    assert promoting(engine, [offload_key(0)], req)
    engine.step()  # a load job, held
    assert engine.tier.has_pending_work()
    engine.store([offload_key(20)], [engine.chunk(sample, 20)])  # a store job after it, which finishes first
    assert until(lambda: bool(engine.results), engine.step)
    first = list(engine.results)
    release.set()
    engine.tier.drain_jobs()  # every job done: all results are there for vLLM's next poll
    engine.step()
    ids = [r.job_id for r in engine.results]
    assert len(first) == 1 and first[0].transfer_bytes == engine.tier.block_size_bytes  # the store, first
    assert len(ids) == len(set(ids)) == 2 and not engine.tier.has_pending_work()
    assert engine.manager.lookup(offload_key(0), req) is LookupResult.HIT
    engine.finish(req)


def test_vllm_may_evict_and_reuse_a_row_once_its_store_job_is_reported(tmp_path, sample):
    """The tier copies the row out before coding and storing it: the job is reported at once, vLLM's rows are
    free, and what is stored is the chunk as it was, whatever vLLM writes into its old row meanwhile."""
    url = f"file://{tmp_path}/store"
    engine = Recorded(url)
    key, chunk = offload_key(1), engine.chunk(sample, 1)
    release = threading.Event()
    put_entry, held_key = engine.tier.store.put_entry, engine.tier.namer.key(key)
    engine.tier.store.put_entry = lambda entry: (entry.key != held_key or release.wait(30)) and put_entry(entry)
    try:
        engine.store([key], [chunk])
        engine.tier.drain_jobs()  # the job finished while its put is held
        engine.step()
        assert engine.results and engine.results[0].success and not engine.stored(key)
        others = [offload_key(100 + i) for i in range(PRIMARY)]
        engine.store(others, [engine.chunk(sample, 100 + i) for i in range(PRIMARY)])  # evicts it, reuses its row
        engine.settle()  # (their jobs reported: the rows free for the promotion below)
        req = engine.request()
        assert engine.primary.lookup(key, req) is LookupResult.MISS
        engine.finish(req)
        found, data = engine.fetch(key, chunk.size)  # waiting to be stored: a hit, from its copy
        assert found is LookupResult.HIT and np.array_equal(data, chunk)
        release.set()
        engine.tier.wait_stored()
        assert engine.stored(key)
    finally:
        release.set()
        engine.close()
    fresh = Recorded(url)  # what was stored: the chunk as it was when the job was reported
    try:
        found, data = fresh.fetch(key, chunk.size)
        assert found is LookupResult.HIT and np.array_equal(data, chunk)
    finally:
        fresh.close()


def test_each_chunk_of_a_store_job_is_stored_or_not_on_its_own(engine, sample, monkeypatch):
    save_row = tier_module.save_row
    bad = engine.tier.namer.key(offload_key(1))

    def failing(store, name, *args):
        if name == bad:
            raise RuntimeError("a chunk that cannot be coded")
        return save_row(store, name, *args)

    monkeypatch.setattr(tier_module, "save_row", failing)
    keys = [offload_key(i) for i in range(3)]
    engine.store(keys, [engine.chunk(sample, i) for i in range(3)])
    engine.tier.wait_stored()
    assert [engine.stored(k) for k in keys] == [True, False, True] and engine.tier.stores_failed == 1


@pytest.mark.parametrize("workers", [2, 4])
def test_one_copy_is_shared_across_tp_sizes_a_sharded_row_never(tmp_path, sample, workers):
    url = f"file://{tmp_path}/store"
    single = Recorded(url)
    keys = [offload_key(i) for i in range(2)]
    chunks = [single.chunk(sample, i) for i in range(2)]
    try:
        single.store(keys, chunks)
        single.tier.wait_stored()
    finally:
        single.close()
    replicated = Recorded(url, Shape(workers=workers, replicated=True))  # every worker holds the same bytes
    try:
        for key, chunk in zip(keys, chunks):
            found, data = replicated.fetch(key, chunk.size)
            assert found is LookupResult.HIT and np.array_equal(data, chunk)
    finally:
        replicated.close()
    sharded = Recorded(url, Shape(workers=workers))  # one cell a worker: its own heads
    try:
        assert sharded.fetch(keys[0], 1)[0] is LookupResult.MISS
        sharded.store([keys[0]], [sharded.chunk(sample, 0)])
        sharded.tier.wait_stored()
        assert sharded.fetch(keys[0], 1)[0] is LookupResult.HIT
    finally:
        sharded.close()
    with open_store(url) as store:
        assert len(store.keys()) == 3  # the two one-copy chunks, and the sharded one apart


def test_reset_cache_and_shutdown_with_work_in_flight(tmp_path, sample):
    url = f"file://{tmp_path}/store"
    engine = Recorded(url)
    release = threading.Event()
    put_entry = engine.tier.store.put_entry
    engine.tier.store.put_entry = lambda entry: release.wait(30) and put_entry(entry)
    keys = [offload_key(i) for i in range(3)]
    engine.store(keys, [engine.chunk(sample, i) for i in range(3)])
    engine.manager.reset_cache()  # vLLM drains the tiers' jobs, then resets its CPU tier
    threading.Timer(0.2, release.set).start()
    engine.close()  # the chunks copied out are still stored
    with open_store(url) as store:
        assert len(store.keys()) == 3
