"""Short versions of benchmarks/lmcache_l2's cold and capacity-bound cells, on LMCache's own classes, without vLLM.

The served cells start three vLLM servers each (one to two and a half minutes apiece on the
2-core development machine) and cannot fit CI's five minutes; these check, with real SmolLM2
chunks, what their comparisons rest on:

- cold: after the cell's drop, none of an L2's chunks is left in the page cache, and loads
  from the disk through LMCache's ``fs`` adapter and kvtool's adapter are bit-exact;
- capacity-bound: under one byte budget enforced by LMCache's own L2 eviction controller (the
  cell's ``eviction`` block, through the cell's timing wrapper), kvtool's adapter keeps at
  least 1.4x the chunks ``fs`` keeps, and loads them back bit-exact, timed.

    .venv-lmcache/bin/python -m pytest tests/lmcache_e2e/test_lmcache_l2_cells.py
"""

from __future__ import annotations

import json
import select
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed here: create its environment with "
                                      "benchmarks/vs_lmcache/lmcache-env.sh")

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.config import EvictionConfig
from lmcache.v1.distributed.storage_controllers.eviction_controller import (
    L2AdapterEvictionState,
    L2EvictionController,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "lmcache_l2"))
import cells
import chunk_part
import pagecache
from chunk_objects import empty_like
from timed_adapter import TimedL2Adapter

CHUNKS = 12


@pytest.fixture
def droppable(tmp_path: Path) -> Path:
    """A folder whose files' pages can leave memory (not so on tmpfs, where the page cache is the file)."""
    probe = tmp_path / "probe" / "file"
    probe.parent.mkdir()
    probe.write_bytes(b"x" * (1 << 20))
    if pagecache.resident_bytes(probe.parent) == 0:
        pytest.fail("a file just written is not in the page cache: resident_bytes does not see it")
    pagecache.drop(probe.parent)
    if pagecache.resident_bytes(probe.parent) != 0:
        pytest.skip(f"{tmp_path} keeps file pages in memory (tmpfs?): there is no cold read to check here")
    probe.read_bytes()
    assert pagecache.resident_bytes(probe.parent) == 1 << 20  # reading brings the pages back
    return tmp_path


def test_cold_loads_leave_nothing_cached_and_are_bit_exact(droppable):
    rows = chunk_part.adapters(("fs", "kvtool"), repeats=1, count=4, cold=True,
                               place_of=lambda label: cells.Place(folder=droppable / label))
    assert [r["config"] for r in rows] == ["fs", "kvtool"]
    for row in rows:
        assert row["bit_exact"], row
        assert row["resident_at_load"] <= 0.01 * row["held_bytes"], row  # a page or two of kvtool's index at most
    fs, kvtool = rows
    assert fs["raw_bytes"] / kvtool["held_bytes"] > 1.4


def _store_all(adapter: TimedL2Adapter, keys: list, chunks: list) -> None:
    task = adapter.submit_store_task(keys, chunks)
    done: dict = {}
    while task not in done:
        select.select([adapter.get_store_event_fd()], [], [], 0.05)
        done.update(adapter.pop_completed_store_tasks())
    assert done[task].is_successful()


def _held_keys(adapter: TimedL2Adapter, keys: list) -> list:
    task = adapter.submit_lookup_and_lock_task(keys, {})
    while (bitmap := adapter.query_lookup_and_lock_result(task)) is None:
        select.select([adapter.get_lookup_and_lock_event_fd()], [], [], 0.05)
    adapter.submit_unlock(keys)
    return [keys[i] for i in bitmap.get_indices_list()]


def _kept_under_budget(name: str, folder: Path, chunks: list, budget: int) -> tuple[int, list[dict]]:
    """Chunks an adapter still holds after LMCache's L2 eviction brought it under ``budget``; its load timings."""
    timings = folder / f"{name}.loads.jsonl"
    spec = cells.lmcache_spec(name, cells.Place(folder=folder / name, budget_bytes=budget), timings)
    adapter = TimedL2Adapter(spec["adapter_params"])
    controller = L2EvictionController([L2AdapterEvictionState(0, adapter, EvictionConfig(**spec["eviction"]))])
    controller.start()
    keys = [ObjectKey(chunk_hash=i.to_bytes(16, "big"), model_name="m", kv_rank=0) for i in range(len(chunks))]
    try:
        assert adapter.supports_global_eviction
        _store_all(adapter, keys, chunks)
        deadline = time.monotonic() + 120
        while adapter.get_usage().usage_fraction >= 1.0 and time.monotonic() < deadline:
            time.sleep(0.2)  # LMCache's controller evicts a tenth of the chunks once a second
        assert adapter.get_usage().total_bytes_used < budget
        held = _held_keys(adapter, keys)
        outs = [empty_like(chunks[keys.index(k)]) for k in held]
        task = adapter.submit_load_task(held, outs)
        while (bitmap := adapter.query_load_result(task)) is None:
            select.select([adapter.get_load_event_fd()], [], [], 0.05)
        assert len(bitmap.get_indices_list()) == len(held)
        assert all(torch.equal(o.raw_data, chunks[keys.index(k)].raw_data) for o, k in zip(outs, held))
    finally:
        controller.stop()
        adapter.close()
    return len(held), [json.loads(line) for line in timings.read_text().splitlines()]


def test_under_one_byte_budget_kvtool_keeps_more_chunks_than_fs(tmp_path):
    chunks = chunk_part.sample_chunks(CHUNKS)
    # Half the raw bytes and half a chunk more: LMCache evicts from the first byte at the budget, so a
    # budget of whole raw chunks would leave fs one chunk fewer than it has room for.
    budget = int((CHUNKS // 2 + 0.5) * chunks[0].get_size())
    fs, fs_loads = _kept_under_budget("fs", tmp_path, chunks, budget)
    kvtool, kvtool_loads = _kept_under_budget("kvtool", tmp_path, chunks, budget)
    assert fs == CHUNKS // 2
    assert kvtool >= 1.4 * fs, (kvtool, fs)
    for loads, held in ((fs_loads, fs), (kvtool_loads, kvtool)):
        assert [(x["keys"], x["loaded"]) for x in loads] == [(held, held)]
        assert loads[0]["seconds"] > 0
