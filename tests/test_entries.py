"""``kvtool.entries``: a cache into a store entry and back into each kind of destination, once per byte.

Every integration saves and restores through these calls; here they run on real
samples against real stores (memory, file, Redis), into the destinations the
integrations use: rows at offsets (LMCache's objects, vLLM's offload rows),
paged blocks (vLLM's CPU cache), and one array.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvtool.kvz.pipeline
import kvtool.store.entry
from kvtool.cache import KVCache
from kvtool.codecs import registry as codecs
from kvtool.codecs.exphuff import ExpHuffCodec
from kvtool.destinations import Arena, Rows
from kvtool.entries import Expected, Miss, put_cache, restore_into
from kvtool.kvz import KvzReader, encode_cache
from kvtool.kvz.format import FLAG_STORED_RAW
from kvtool.kvz.pipeline import NativeBatch, PerChunk
from kvtool.kvz.reader import pipeline_for
from kvtool.modeldict import registry as dictionaries
from kvtool.modeldict.train import train
from kvtool.store import open_store

from native_checks import needs_core

RECIPES = ["exphuff", "byteplane|zstd:1", "int:4,group=64|zstd:3", "none"]


def small(path, tokens: int = 40) -> KVCache:
    return KVCache.load(path, layers=[0, 1, 2], tokens=slice(0, tokens))


def expected_of(cache: KVCache) -> Expected:
    return Expected(len(cache.keys), cache.keys[0].shape, cache.dtype.name)


def decoded(cache: KVCache, recipe: str) -> KVCache:
    """What the container gives back for ``recipe`` (the cache itself for a lossless one)."""
    return KvzReader.from_bytes(encode_cache(cache, recipe, chunk_tokens=cache.num_tokens)).read()


def row_destination(cache: KVCache) -> tuple[Rows, np.ndarray]:
    """A flat buffer where tensor i's rows sit reversed, tensor after tensor: rows at offsets no array layout has."""
    heads, tokens, dim = cache.keys[0].shape
    row = dim * cache.dtype.itemsize
    n = 2 * len(cache.keys)
    rows = (np.arange(n * heads * tokens, dtype=np.int64)[::-1] * row).reshape(n, heads, tokens)
    out = np.zeros(n * heads * tokens * row, np.uint8)
    return Rows([out], rows, [0] * n), out


def rows_back(cache: KVCache, out: np.ndarray) -> list[np.ndarray]:
    """The tensors a ``row_destination`` holds, K then V of each layer."""
    heads, tokens, dim = cache.keys[0].shape
    n = 2 * len(cache.keys)
    flat = out.view(cache.dtype.numpy).reshape(-1, dim)[::-1].reshape(n, heads, tokens, dim)
    return list(flat)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_cache_comes_back_into_rows_and_into_an_array(samples, recipe):
    cache = small(samples[0])
    want = decoded(cache, recipe)
    with open_store("memory://") as store:
        put = put_cache(store, "e", cache, recipe, meta={"note": "x"})
        assert put.stored and put.raw_bytes == cache.nbytes and 0 < put.stored_bytes
        assert store.info("e").meta == {"note": "x", "tokens": cache.num_tokens, "raw_bytes": cache.nbytes}
        destination, out = row_destination(cache)
        restored = restore_into(store, "e", expected_of(cache), destination)
        assert restored.ok and restored.tier == "memory" and restored.raw_bytes == cache.nbytes
        got = rows_back(cache, out)
        for i, (layer, kind, array) in enumerate(want.tensors()):
            assert got[i].tobytes() == np.ascontiguousarray(array).tobytes(), (layer, kind)
        arena = np.zeros((2, *cache.keys[0].shape[:1], 10, cache.keys[0].shape[2]), cache.dtype.numpy)
        assert restore_into(store, "e", expected_of(cache), Arena(arena), layers=[1], tokens=slice(5, 15)).ok
        assert arena[0].tobytes() == np.ascontiguousarray(want.keys[1][:, 5:15]).tobytes()
        assert arena[1].tobytes() == np.ascontiguousarray(want.values[1][:, 5:15]).tobytes()


def test_a_cache_comes_back_into_paged_blocks(samples):
    torch = pytest.importorskip("torch")
    from kvtool.torchbits import paged_blocks

    cache = small(samples[1], tokens=32)  # 4 blocks of 8 tokens
    heads, _, dim = cache.keys[0].shape
    pages = [torch.zeros(6, heads, 2 * 8, dim, dtype=torch.bfloat16) for _ in cache.keys]  # CPU layout: K rows, V rows
    views = [view for page in pages for view in (page[:, :, :8], page[:, :, 8:])]
    with open_store("memory://") as store:
        assert put_cache(store, "e", cache, "exphuff").stored
        assert restore_into(store, "e", expected_of(cache), paged_blocks(views, [5, 0, 3, 1], skip=8)).ok
    for i, array in enumerate(a for pair in zip(cache.keys, cache.values) for a in pair):
        got = views[i][[0, 3, 1]].permute(1, 0, 2, 3).reshape(heads, 24, dim)  # tokens 8..31: the first 8 were skipped
        assert got.view(torch.int16).numpy().tobytes() == np.ascontiguousarray(array[:, 8:]).view(np.int16).tobytes()
        assert views[i][5].abs().sum() == 0  # the skipped tokens' block is untouched


def test_every_failure_is_a_miss_with_its_cause(samples, tmp_path):
    cache = small(samples[0])
    destination, _ = row_destination(cache)
    expected = expected_of(cache)
    with open_store(f"file://{tmp_path}/kv") as store:
        assert restore_into(store, "absent", expected, destination).miss is Miss.MISSING
        put_cache(store, "e", cache, "exphuff")
        other = Expected(2, expected.shape, expected.dtype)
        assert restore_into(store, "e", other, destination).miss is Miss.MISMATCH
        assert restore_into(store, "e", Expected(3, expected.shape, "fp16"), destination).miss is Miss.MISMATCH
        record = bytearray(store.read_record("e"))
        record[len(record) // 2] ^= 0x04
        store.write_record("e", bytes(record))
        damaged = restore_into(store, "e", expected, destination)
        assert damaged.miss is Miss.DAMAGED and "checksum" in damaged.detail
        assert not store.contains("e")  # dropped, as a failed record check would have
    with open_store("redis://127.0.0.1:1/0") as down:
        assert restore_into(down, "e", expected, destination).miss is Miss.UNREACHABLE


def test_an_entry_that_names_an_unknown_dictionary_stays(samples, tmp_path, monkeypatch):
    cache = small(samples[0])
    dictionary = train([KVCache.load(samples[0], layers=[0, 1])], classes=2)
    dictionaries.register(dictionary)
    destination, _ = row_destination(cache)
    with open_store("memory://") as store:
        assert put_cache(store, "e", cache, f"ctxtans:{dictionary.id}").stored
        monkeypatch.setattr(dictionaries, "_known", {})  # a process that has never seen the dictionary
        monkeypatch.setattr(dictionaries, "_files", {})
        monkeypatch.setenv(dictionaries.PATH_VARIABLE, str(tmp_path))
        assert restore_into(store, "e", expected_of(cache), destination).miss is Miss.UNDECODABLE
        assert store.contains("e")  # a process that has the dictionary still restores it


@pytest.fixture(params=["file", "redis"])
def shared_store(request, tmp_path):
    url = f"file://{tmp_path}/kv" if request.param == "file" else request.getfixturevalue("redis_url")
    with open_store(url) as store:
        yield store


class Counted:
    """Bytes hashed by the store's record check and by the reader's per-chunk checks, and the store's reads."""

    def __init__(self, monkeypatch, store):
        self.record_bytes = self.chunk_bytes = self.reads = self.lookups = 0
        real_digest, real_chunk, real_read, real_contains = (kvtool.store.entry.xxhash.xxh3_64,
                                                              kvtool.kvz.pipeline.xxh3_64, store._read_result,
                                                              store._contains)

        class Digest:
            def __init__(inner, data=b""):
                inner.digest = real_digest(data)
                self.record_bytes += len(memoryview(data).cast("B")) if data else 0

            def update(inner, data):
                self.record_bytes += len(memoryview(data).cast("B"))
                inner.digest.update(data)

            def intdigest(inner):
                return inner.digest.intdigest()

        def chunk(data):
            self.chunk_bytes += len(memoryview(data).cast("B"))
            return real_chunk(data)

        def read(key):
            self.reads += 1
            return real_read(key)

        def contains(key):
            self.lookups += 1
            return real_contains(key)

        monkeypatch.setattr(kvtool.store.entry.xxhash, "xxh3_64", Digest)
        monkeypatch.setattr(kvtool.kvz.pipeline, "xxh3_64", chunk)
        monkeypatch.setattr(store, "_read_result", read)
        monkeypatch.setattr(store, "_contains", contains)


def test_a_restore_fetches_once_and_hashes_each_stored_byte_once(samples, shared_store, monkeypatch):
    """A per-chunk recipe, so that every check runs where it can be counted: the record's value is not hashed by
    the store (the reader checks each chunk), each chunk's stored bytes once, and the store is read once."""
    cache = small(samples[1])
    recipe = "byteplane|zstd:1"
    assert put_cache(shared_store, "e", cache, recipe).stored
    index = KvzReader.from_bytes(encode_cache(cache, recipe, chunk_tokens=cache.num_tokens)).index
    stored = int(index["stored_len"].sum())
    coded = (index["flags"] & FLAG_STORED_RAW) == 0
    raw = int(index["raw_len"][coded].sum())  # a chunk stored raw: its stored checksum is its raw one
    assert 0 < raw < cache.nbytes
    destination, _ = row_destination(cache)
    counted = Counted(monkeypatch, shared_store)
    restored = restore_into(shared_store, "e", expected_of(cache), destination)
    assert restored.ok and restored.tier == shared_store.name
    assert (counted.reads, counted.lookups, counted.record_bytes) == (1, 0, 0)
    assert counted.chunk_bytes == stored + raw  # each stored chunk checked once, and each decoded plane once


def test_the_native_path_hashes_nothing_in_python_and_reads_once(samples, shared_store, monkeypatch):
    cache = small(samples[0])
    assert put_cache(shared_store, "e", cache, "exphuff").stored
    destination, out = row_destination(cache)
    counted = Counted(monkeypatch, shared_store)
    assert restore_into(shared_store, "e", expected_of(cache), destination).ok
    assert (counted.reads, counted.lookups, counted.record_bytes) == (1, 0, 0)
    assert [a.tobytes() for a in rows_back(cache, out)] == [np.ascontiguousarray(a).tobytes() for _, _, a in cache.tensors()]


class PluginExpHuff(ExpHuffCodec):
    """A third party's codec: exphuff's chunks under its own id, offering the core's batch kernel."""

    codec_id = "test-plugin-exphuff"


class PluginNoKernel(ExpHuffCodec):
    """The same chunks, offering no batch kernel: the per-chunk path."""

    codec_id = "test-plugin-exphuff-slow"

    def batch_kernel(self, dtype):
        return None


@pytest.fixture
def plugins():
    """The two plug-in codecs, registered for one test: the registry holds only the built-ins after it."""
    for cls in (PluginExpHuff, PluginNoKernel):
        codecs.register(cls.codec_id, cls)
    yield
    for cls in (PluginExpHuff, PluginNoKernel):
        codecs.unregister(cls.codec_id)


@needs_core
def test_a_plugin_codec_with_a_batch_kernel_gets_the_native_path_with_no_edit_elsewhere(samples, plugins):
    cache = small(samples[0])
    fast, slow = (encode_cache(cache, recipe, chunk_tokens=16) for recipe in (PluginExpHuff.codec_id, PluginNoKernel.codec_id))
    fast_reader, slow_reader = KvzReader.from_bytes(fast), KvzReader.from_bytes(slow)
    assert isinstance(pipeline_for(fast_reader.header), NativeBatch)
    assert isinstance(pipeline_for(slow_reader.header), PerChunk)
    assert fast_reader.index["stored_xxh3"].tolist() == slow_reader.index["stored_xxh3"].tolist()  # the same chunks
    for reader in (fast_reader, slow_reader):
        assert [a.tobytes() for _, _, a in reader.read().tensors()] == [a.tobytes() for _, _, a in cache.tensors()]


def test_stages_say_what_they_can_do(plugins):
    from kvtool.recipe import Recipe

    assert Recipe.parse("exphuff-lanes").gpu_decodes and not Recipe.parse("exphuff").gpu_decodes
    assert Recipe.parse("ctxtans").uses_dictionary and not Recipe.parse("zstd:3").uses_dictionary
    assert Recipe.parse("byteplane|zstd:1").batch_kernel(np.dtype(np.float16)) is None  # a layout comes first
    assert Recipe.parse("int:4|lz4").stage_kernel(np.dtype(np.float16)) is None  # lz4 does not hand planes over
