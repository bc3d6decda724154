"""The lossy ``int`` stage's batch restore: the same bytes as the per-chunk path and as the numpy reference, on the
real samples, for every option of the stage and every destination; damage refused as the per-chunk path refuses it."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import xxhash
import zstandard

from kvtool._native.int_batch import Declined, IntBatchCodec, error_stats, int_jobs
from kvtool.cache import KVCache
from kvtool.integrations.vllm_offload.chunks import load_row, save_row
from kvtool.integrations.vllm_offload.rows import RowLayout
from kvtool.kvz import KvzCorruptError, KvzReader, encode_cache
from kvtool.kvz.format import FLAG_STORED_RAW
from kvtool.kvz.int_pipeline import IntBatch
from kvtool.kvz.pipeline import PerChunk
from kvtool.layouts.int_quant import IntQuant
from kvtool.store.memory import MemoryStore

from native_checks import needs_core


#: Every option of the int stage: widths, axes both ways, groups that do and do not divide the block, per-kind and
#: per-layer widths.
RECIPES = [
    "int:6,group=64|zstd:3",
    "int:4|zstd:3",
    "int:8,group=64|zstd:3",
    "int:1,group=16|zstd:1",
    "int:3,k=token,v=channel,group=50|zstd:3",
    "int:5,k=channel,v=channel,group=7|zstd:3",
    "int:7,k=token,v=token,group=300|zstd:3",
    "int:2,kbits=6,vbits=3|zstd:3",
    "int:4,group=64,kbits=5,layers=k0:8+k3:6+v5:1+v7:2|zstd:3",
    "int:3,group=64,codes=ctx|zstd:3",
    "int:4,group=64,kbits=5,layers=k0:8+k3:6+v5:1+v7:2,codes=ctx|zstd:3",
]


def tensors(cache: KVCache) -> list[np.ndarray]:
    return [array for _, _, array in cache.tensors()]


def assert_same(a: KVCache, b: KVCache) -> None:
    for x, y in zip(tensors(a), tensors(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


def per_chunk(blob: bytes) -> KvzReader:
    reader = KvzReader.from_bytes(blob)
    reader._pipeline = PerChunk(reader.header)
    return reader


def reference(blob: bytes, monkeypatch: pytest.MonkeyPatch, **read) -> KVCache:
    """What the per-chunk path restores with the numpy reference of the stage (as under KVTOOL_NATIVE=0)."""
    with monkeypatch.context() as m:
        m.setattr(IntQuant, "_native_inverse", lambda self, planes, spec, out: False)
        return per_chunk(blob).read(**read)


def cast(cache: KVCache, dtype) -> KVCache:
    return KVCache([k.astype(dtype) for k in cache.keys], [v.astype(dtype) for v in cache.values], cache.model,
                   layer_ids=cache.layer_ids)


@needs_core
@pytest.mark.parametrize("recipe", RECIPES)
def test_batch_restores_the_per_chunk_and_reference_bytes(samples, recipe, monkeypatch):
    for path in samples:
        cache = KVCache.load(path, layers=list(range(8)))
        blob = encode_cache(cache, recipe, chunk_tokens=100)  # a last block of another size
        reader = KvzReader.from_bytes(blob)
        assert isinstance(reader._pipeline, IntBatch)
        restored = reader.read()
        assert_same(restored, per_chunk(blob).read())
        assert_same(restored, reference(blob, monkeypatch))
        some = {"layers": [1, 6], "tokens": slice(37, 211)}  # begins and ends inside blocks
        assert_same(KvzReader.from_bytes(blob).read(**some, threads=2), reference(blob, monkeypatch, **some))


@needs_core
@pytest.mark.parametrize("dtype", [np.float16, np.float32, ml_dtypes.bfloat16])
def test_every_dtype_the_stage_takes(samples, dtype, monkeypatch):
    cache = cast(KVCache.load(samples[0], layers=[0, 4, 9], tokens=slice(0, 150)), dtype)
    for recipe in ("int:5,group=32|zstd:3", "int:4,k=token,v=channel,group=20|zstd:3"):
        blob = encode_cache(cache, recipe, chunk_tokens=64)
        assert isinstance(KvzReader.from_bytes(blob)._pipeline, IntBatch)
        assert_same(KvzReader.from_bytes(blob).read(threads=3), reference(blob, monkeypatch))


@needs_core
@pytest.mark.parametrize("recipe", ["mant-round:4|byteplane|zstd:3", "fp8:e4m3|zstd:3", "int:4|zstd:3,scales=lz4",
                                    "int:4|byteplane|zstd:3"])
def test_other_recipes_keep_their_path(samples, recipe):
    cache = KVCache.load(samples[0], layers=[0, 1], tokens=slice(0, 64))
    reader = KvzReader.from_bytes(encode_cache(cache, recipe, chunk_tokens=32))
    assert type(reader._pipeline) is PerChunk


@needs_core
@pytest.mark.parametrize("recipe", ["int:6,group=64|zstd:3", "int:3,k=token,v=channel,group=50|zstd:3",
                                    "int:3,group=64,codes=ctx|zstd:3"])
def test_rows_and_blocks_are_what_a_read_restores(samples, recipe):
    """Paged rows (some left out, at random places) and streamed blocks: the bytes of ``read``."""
    cache = KVCache.load(samples[1], layers=[0, 5, 9], tokens=slice(0, 120))
    heads, tokens, dim = cache.keys[0].shape
    blob = encode_cache(cache, recipe, chunk_tokens=48)
    expected = np.stack(tensors(KvzReader.from_bytes(blob).read()))
    rng = np.random.default_rng(5)
    order = rng.permutation(6 * heads * tokens).reshape(6, heads, tokens).astype(np.int64)
    rows = order * dim * 2
    rows[:, :, :10] = -1
    target = np.zeros(6 * heads * tokens * dim, expected.dtype)
    with KvzReader.from_bytes(blob) as reader:
        assert isinstance(reader._pipeline, IntBatch)
        reader.read_rows([target], rows, [0] * 6)
    got = target.reshape(-1, dim)[order.reshape(-1)].reshape(expected.shape)
    assert np.array_equal(got[:, :, 10:].view(np.uint16), expected[:, :, 10:].view(np.uint16))
    assert not got[:, :, :10].view(np.uint16).any()
    seen = np.zeros_like(expected)

    def keep(tensor: int, token: int, block: np.ndarray) -> None:
        seen[tensor, :, token : token + block.shape[1]] = block

    KvzReader.from_bytes(blob).iter_blocks(keep, threads=2)
    assert np.array_equal(seen.view(np.uint16), expected.view(np.uint16))
    KvzReader.from_bytes(blob).verify(full=True)


@needs_core
def test_the_store_path_restores_an_offload_row(samples):
    """vLLM's offload tier: an entry in a store decodes through the batch into the row's own bytes."""
    layout = RowLayout.from_config(offload_config(), -(-49152 // mmap.PAGESIZE) * mmap.PAGESIZE, False, 64)
    sample = KVCache.load(samples[0])
    region = np.zeros((3, layout.row_stride), np.uint8)
    region[1, :layout.used_bytes] = np.concatenate([sample.keys[0].reshape(-1), sample.values[0].reshape(-1)]) \
        .view(np.uint8)[:layout.used_bytes]
    store, recipe = MemoryStore(), "int:6,group=16|zstd:3"
    assert save_row(store, "k", region, 1, layout, recipe)
    entry = store.get_entry("k")
    assert entry is not None and isinstance(KvzReader.from_bytes(entry.value)._pipeline, IntBatch)
    restored = np.zeros_like(region)
    assert load_row(store, "k", restored, 2, layout, layout.row_offsets())
    expected = np.zeros_like(region)
    reader = per_chunk(entry.value)
    reader.read_rows([expected.reshape(-1)], layout.row_offsets() + 2 * layout.row_stride, [0] * len(layout.row_offsets()))
    assert np.array_equal(restored, expected) and restored[2].any() and not restored[:2].any()


def offload_config() -> SimpleNamespace:
    """vLLM 0.32's ``OffloadingConfig`` as the tier reads it (tests/test_vllm_offload_rows.py): 3 heads of 64, bf16,
    2 layers, 2 blocks of 16 tokens a row."""
    group = SimpleNamespace(tokens_per_block=16, layer_names=("l0", "l1"))
    return SimpleNamespace(
        canonical_layout=False, kv_cache_layout="LBNHC", worker_kv_bytes_per_block=2 * 16 * 3 * 2 * 64 * 2,
        groups=(group,), model=SimpleNamespace(name="m", dtype="bfloat16"),
        cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=2),
        parallel=SimpleNamespace(world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1),
    )


def damaged(blob: bytes, row: int, at: int = 0) -> bytes:
    """``blob`` with a byte of index record ``row``'s stored chunk flipped."""
    reader = KvzReader.from_bytes(blob)
    offset = int(reader.index[row]["offset"]) + at
    out = bytearray(blob)
    out[offset] ^= 0x40
    return bytes(out)


def refusal(read) -> tuple[type, int | None]:
    with pytest.raises(KvzCorruptError) as info:
        read()
    return type(info.value), info.value.chunk


@needs_core
@pytest.mark.parametrize("plane", ["codes", "scales", "raw"])
@pytest.mark.parametrize("recipe", ["int:6,group=64|zstd:3", "int:3,group=64,codes=ctx|zstd:3"])
def test_damage_is_refused_as_the_per_chunk_path_refuses_it(samples, plane, recipe):
    cache = KVCache.load(samples[0], layers=[0, 1, 2], tokens=slice(0, 96))
    blob = encode_cache(cache, recipe, chunk_tokens=32)
    index = KvzReader.from_bytes(blob).index
    raw = (index["flags"] & FLAG_STORED_RAW) != 0
    rows = {"codes": np.flatnonzero((index["plane"] == 0) & ~raw), "scales": np.flatnonzero(index["plane"] == 1),
            "raw": np.flatnonzero(raw)}[plane]
    assert len(rows), f"no {plane} chunk to damage"
    bad = damaged(blob, int(rows[len(rows) // 2]), at=5)
    batch = refusal(lambda: KvzReader.from_bytes(bad).read())
    assert batch == refusal(lambda: per_chunk(bad).read()) == (KvzCorruptError, int(rows[len(rows) // 2]))
    heads, tokens, dim = cache.keys[0].shape
    target = np.zeros(6 * heads * tokens * dim, np.uint16)
    offsets = (np.arange(6 * heads * tokens, dtype=np.int64) * dim * 2).reshape(6, heads, tokens)
    assert refusal(lambda: KvzReader.from_bytes(bad).read_rows([target], offsets, [0] * 6)) == batch
    assert refusal(lambda: KvzReader.from_bytes(bad).verify(full=True)) == batch


@needs_core
def test_rows_outside_their_target_are_refused_before_a_byte_moves(samples):
    cache = KVCache.load(samples[0], layers=[0], tokens=slice(0, 64))
    heads, tokens, dim = cache.keys[0].shape
    blob = encode_cache(cache, "int:4|zstd:3", chunk_tokens=32)
    target = np.zeros(2 * heads * tokens * dim, np.uint16)
    rows = (np.arange(2 * heads * tokens, dtype=np.int64) * dim * 2).reshape(2, heads, tokens)
    reader = KvzReader.from_bytes(blob)
    job = int_jobs(1)
    job["block_tokens"], job["groups_per_head"], job["bits"] = 32, 32, 4
    planes = [bytes(heads * 32 * dim // 2), bytes(heads * 32 * 4)]
    batch = reader._pipeline.batch
    with pytest.raises(Exception, match="does not fit its destination"):
        batch.decode(planes, job, rows.reshape(-1)[: heads * 32] + target.nbytes, [target], heads, dim)
    assert not target.any()
    reader.read_rows([target], rows, [0, 0])  # the same reader, the right offsets
    assert target.any()


@needs_core
def test_non_finite_scales_are_left_to_the_reference(samples, monkeypatch):
    """The core declines a block whose scales are not finite (only a crafted file has them); the run then goes per
    chunk, to the numpy reference, as it did before the batch path."""
    heads, dim = 3, 64
    codec = KvzReader.from_bytes(
        encode_cache(KVCache.load(samples[0], layers=[0], tokens=slice(0, 8)), "int:4|zstd:3")).recipe.stage_kernel(np.float32)
    assert codec is not None
    job = int_jobs(1)
    job["block_tokens"], job["groups_per_head"], job["bits"], job["flags"], job["token_hi"] = 8, 16, 4, 4, 8
    job["head_stride"] = 8 * dim * 4
    scales = np.zeros((heads, 16, 2), np.float16)  # 8 tokens of 2 groups of 32 channels
    scales[1, 3, 0] = np.inf
    with pytest.raises(Declined):
        codec.decode([bytes(heads * 8 * dim), scales.tobytes()], job, np.zeros(0, np.int64),
                     [np.zeros(heads * 8 * dim * 4, np.uint8)], heads, dim)
    cache = KVCache.load(samples[0], layers=[0, 1], tokens=slice(0, 100))
    blob = encode_cache(cache, "int:6,group=64|zstd:3", chunk_tokens=32)
    expected = per_chunk(blob).read()

    def decline(self, *args, **kwargs):
        raise Declined(0)

    monkeypatch.setattr(IntBatchCodec, "decode", decline)
    assert_same(KvzReader.from_bytes(blob).read(tokens=slice(5, 90)), per_chunk(blob).read(tokens=slice(5, 90)))
    assert_same(KvzReader.from_bytes(blob).read(), expected)


@needs_core
def test_error_statistics_are_numpys_bits(samples):
    """What a lossy write records per block, from the core, equals numpy's float64 computation bit for bit."""
    rng = np.random.default_rng(11)
    cache = KVCache.load(samples[0])
    blocks = [(a[:, :n], (a[:, :n].astype(np.float32) * 1.003).astype(a.dtype)) for a in tensors(cache)[:12] for n in (1, 37, 256)]
    for dtype in (np.float16, np.float32, ml_dtypes.bfloat16):
        for n in (0, 1, 7, 8, 9, 127, 128, 129, 1000, 8193, 49152, 98311):
            x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 40.0])).astype(dtype)
            blocks.append((x, (x.astype(np.float32) + rng.standard_normal(n).astype(np.float32) * 0.01).astype(dtype)))
    for exact, approx in blocks:
        values = exact.astype(np.float64)
        error = approx.astype(np.float64) - values
        numpy = (float(np.abs(error).max(initial=0.0)), float(np.square(error).sum()), float(np.square(values).sum()))
        assert error_stats(exact, approx) == numpy


@needs_core
def test_a_coded_codes_plane_with_good_checksums_but_bad_content_is_refused_as_per_chunk(samples):
    """``codes=ctx``: a crafted file whose first coded codes plane has no valid mode, every checksum made anew."""
    sys.path.insert(0, str(Path(__file__).with_name("fuzz")))
    from forge import assemble, dissect

    cache = KVCache.load(samples[0], layers=[0, 1], tokens=slice(0, 64))
    parts = dissect(encode_cache(cache, "int:3,group=64,codes=ctx|zstd:3", chunk_tokens=32))
    stored_raw = bool(parts.index[0]["flags"] & FLAG_STORED_RAW)  # coded codes seldom shrink under zstd
    assert parts.index[0]["plane"] == 0
    raw = bytearray(parts.chunks[0] if stored_raw else zstandard.ZstdDecompressor().decompress(parts.chunks[0]))
    assert raw[0] == 1  # coded
    raw[0] = 7  # no such mode
    parts.chunks[0] = bytes(raw) if stored_raw else zstandard.ZstdCompressor(level=3).compress(bytes(raw))
    parts.index[0]["raw_xxh3"] = xxhash.xxh3_64_intdigest(bytes(raw))
    blob = assemble(parts)
    assert isinstance(KvzReader.from_bytes(blob)._pipeline, IntBatch)
    batch = refusal(lambda: KvzReader.from_bytes(blob).read())
    assert batch == refusal(lambda: per_chunk(blob).read()) == (KvzCorruptError, 0)
