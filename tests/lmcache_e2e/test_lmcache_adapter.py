"""kvtool's L2 adapter against LMCache 0.5.6's own classes: its memory objects, keys, bitmaps, config parser and ``lmcache bench l2``.

    .venv-lmcache/bin/python -m pytest tests/lmcache_e2e/test_lmcache_adapter.py

The chunks are the real SmolLM2 samples laid out as LMCache's multi-process
server lays out a chunk (``[2, layers, tokens, KV heads x head dim]``). LMCache
0.5.6 ships no conformance suite for adapters; these tests hold the adapter to
the contract of ``L2AdapterInterface`` (base.py) the way LMCache's own adapter
tests do, and ``lmcache bench l2 --no-skip-verify`` checks it as LMCache would.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed here: create its environment with "
                                      "benchmarks/vs_lmcache/lmcache-env.sh")
from chunk_objects import empty_like, kv_chunk, memory_obj  # noqa: E402  (beside this file)
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config  # noqa: E402

from kvtool.store import open_store  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def key(n: int, salt: str = "", rank: int = 0) -> ObjectKey:
    return ObjectKey(chunk_hash=n.to_bytes(16, "big"), model_name=MODEL, kv_rank=rank, cache_salt=salt)


def adapter_of(params: dict):
    spec = {"type": "plugin", "module_path": "kvtool.integrations.lmcache", "class_name": "KvtoolL2Adapter",
            "adapter_params": params}
    import argparse

    config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)])).adapters[0]
    return create_l2_adapter(config)


def wait(query, task, fd: int, timeout: float = 60.0):
    """The task's result once its event fd has been signalled."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = query(task)
        if result is not None:
            return result
        select.select([fd], [], [], 0.05)
    raise AssertionError(f"task {task} did not finish in {timeout} s")


def store(adapter, keys, objs) -> dict:
    task = adapter.submit_store_task(keys, objs)
    fd = adapter.get_store_event_fd()
    deadline = time.monotonic() + 60
    done: dict = {}
    while task not in done and time.monotonic() < deadline:
        select.select([fd], [], [], 0.05)
        done.update(adapter.pop_completed_store_tasks())
    return done[task]


def lookup(adapter, keys) -> list[bool]:
    task = adapter.submit_lookup_and_lock_task(keys, {})
    bitmap = wait(adapter.query_lookup_and_lock_result, task, adapter.get_lookup_and_lock_event_fd())
    return [i in set(bitmap.get_indices_list()) for i in range(len(keys))]


def load(adapter, keys, objs) -> list[bool]:
    task = adapter.submit_load_task(keys, objs)
    bitmap = wait(adapter.query_load_result, task, adapter.get_load_event_fd())
    return [i in set(bitmap.get_indices_list()) for i in range(len(keys))]


@pytest.fixture
def chunks():
    return [memory_obj(kv_chunk("code.safetensors")), memory_obj(kv_chunk("prose.safetensors"))]


def test_round_trip_is_bit_exact_and_compressed(tmp_path, chunks):
    adapter = adapter_of({"store": f"file://{tmp_path}/kv"})
    try:
        keys = [key(1), key(2)]
        result = store(adapter, keys, chunks)
        assert result.is_successful()
        raw = sum(c.get_size() for c in chunks)
        assert 0 < result.bytes_transferred() < raw / 1.3  # the default lossless recipe, on real KV
        assert lookup(adapter, keys + [key(3)]) == [True, True, False]
        outs = [empty_like(c) for c in chunks]
        assert load(adapter, keys, outs) == [True, True]
        for out, chunk in zip(outs, chunks):
            assert bytes(out.byte_array) == bytes(chunk.byte_array)
        counters = adapter.report_status()["counters"]
        assert counters["chunks_stored|kv"] == 2 and counters["chunks_loaded"] == 2
        assert counters["stored_raw_bytes"] == raw and counters["loaded_raw_bytes"] == raw
        usage = adapter.get_usage()
        assert usage.total_bytes_used == result.bytes_transferred() and dict(usage.bytes_by_cache_salt) == {
            "": result.bytes_transferred()}
        assert store(adapter, keys, chunks).bytes_transferred() == 0  # already there: not coded again
    finally:
        adapter.close()


def test_salt_rank_and_recipe_keep_entries_apart(tmp_path, chunks):
    url = f"file://{tmp_path}/kv"
    adapter = adapter_of({"store": url})
    try:
        assert store(adapter, [key(1, salt="tenant-a")], chunks[:1]).is_successful()
        assert lookup(adapter, [key(1, salt="tenant-a"), key(1, salt="tenant-b"), key(1), key(1, "tenant-a", 1)]) \
            == [True, False, False, False]
        assert load(adapter, [key(1, salt="tenant-b")], [empty_like(chunks[0])]) == [False]
        assert dict(adapter.get_usage().bytes_by_cache_salt).keys() == {"tenant-a"}
    finally:
        adapter.close()
    lossy = adapter_of({"store": url, "recipe": "int:4,group=64|zstd:3"})
    try:
        assert lookup(lossy, [key(1, salt="tenant-a")]) == [False]  # a lossless entry never answers lossy, and back
        assert lossy.report_status()["counters"]["chunks_reindexed"] == 0
    finally:
        lossy.close()


def test_restart_finds_every_chunk_again(tmp_path, chunks):
    url = f"file://{tmp_path}/kv"
    first = adapter_of({"store": url})
    sizes = store(first, [key(1, "a"), key(2, "b")], chunks).bytes_transferred()
    first.close()
    second = adapter_of({"store": url})
    try:
        assert second.report_status()["counters"]["chunks_reindexed"] == 2
        usage = second.get_usage()
        assert set(usage.bytes_by_cache_salt) == {"a", "b"} and usage.total_bytes_used >= sizes
        seen = []

        class Listener:
            def on_l2_keys_stored(self, keys, sizes):
                seen.extend(keys)

            def on_l2_keys_accessed(self, keys):
                pass

            def on_l2_keys_deleted(self, keys):
                pass

        second.register_listener(Listener())  # LMCache's controllers hear of the chunks found again
        assert sorted(k.cache_salt for k in seen) == ["a", "b"]
        out = empty_like(chunks[1])
        assert load(second, [key(2, "b")], [out]) == [True]
        assert bytes(out.byte_array) == bytes(chunks[1].byte_array)
        second.delete([key(2, "b")])
        assert lookup(second, [key(1, "a"), key(2, "b")]) == [True, False]
        assert set(second.get_usage().bytes_by_cache_salt) == {"a"}
    finally:
        second.close()


def test_damaged_missing_mismatched_are_misses(tmp_path, chunks):
    url = f"file://{tmp_path}/kv"
    adapter = adapter_of({"store": url})
    try:
        store(adapter, [key(1), key(2)], chunks)
        kv = open_store(url)
        (damaged,) = [k for k in kv.keys() if kv.info(k).meta["lmcache"]["chunk"] == key(1).chunk_hash.hex()]
        record = bytearray(kv.read_record(damaged))
        record[len(record) // 2] ^= 0x40
        kv.write_record(damaged, bytes(record))
        kv.close()
        small = memory_obj(kv_chunk("prose.safetensors", tokens=128))  # another chunk size: another layout
        outs = [empty_like(chunks[0]), empty_like(chunks[0]), small]
        assert load(adapter, [key(1), key(9), key(2)], outs) == [False, False, False]
        failures = {k: v for k, v in adapter.report_status()["counters"].items() if k.startswith("load_failures")}
        assert failures == {"load_failures|damaged": 1, "load_failures|missing": 1, "load_failures|mismatch": 1}
    finally:
        adapter.close()


def test_a_store_that_is_down_gives_misses(chunks):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    adapter = adapter_of({"store": f"redis://127.0.0.1:{port}/0"})
    try:
        assert not store(adapter, [key(1)], chunks[:1]).is_successful()
        assert lookup(adapter, [key(1)]) == [False]
        assert load(adapter, [key(1)], [empty_like(chunks[0])]) == [False]
    finally:
        adapter.close()


def test_bad_options_are_refused_at_startup(tmp_path):
    for params, words in [({}, "'store'"), ({"store": "file:///x", "recipe": "nope"}, "nope"),
                          ({"store": "file:///x", "workers": 0}, "workers"), ({"store": "file:///x", "x": 1}, "unknown")]:
        with pytest.raises(ValueError, match=words):
            adapter_of(params)


def test_lmcache_bench_l2_verifies_the_adapter(tmp_path):
    spec = {"type": "plugin", "module_path": "kvtool.integrations.lmcache", "class_name": "KvtoolL2Adapter",
            "adapter_params": {"store": f"file://{tmp_path}/bench"}}
    lmcache = Path(sys.executable).with_name("lmcache")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "LMCACHE_DISABLE_BANNER": "1"}
    run = subprocess.run([str(lmcache), "bench", "l2", "--l2-adapter", json.dumps(spec), "--num-keys", "8",
                          "--in-flight", "2", "--no-skip-verify", "--lookup-max-hit-rate", "1.0"],
                         capture_output=True, text=True, timeout=600, env=env, check=False)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "All 16 keys data verified OK" in out, out[-4000:]
    assert "success_keys=16/16" in out and "loaded=16/16" in out, out[-4000:]
