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
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed here: create its environment with "
                                      "benchmarks/vs_lmcache/lmcache-env.sh")
from chunk_objects import empty_like, kv_chunk, memory_obj  # noqa: E402  (beside this file)
from l2_calls import Listener, adapter_of, key, load, lookup, store  # noqa: E402

from kvtool.store import open_store  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


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
        listener = Listener()
        second.register_listener(listener)  # LMCache's controllers hear of the chunks found again
        assert sorted(k.cache_salt for k, _ in listener.stored) == ["a", "b"]
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
