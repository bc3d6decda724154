"""The core's restore kernels at every vector level this CPU has (the portable one everywhere): exphuff decoded
straight into rows in any order, hashed in pieces as written, equal to the numpy reference bit for bit; and a
wrong checksum still caught."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool import _native
from kvtool._native import lanes_reference, reference
from kvtool._native.batch import BatchCodec, ChunkDecodeError, Chunks
from kvtool.cache import KVCache
from kvtool.testing.arraycodecs import DTYPES

from float_blocks import float_blocks
from native_checks import needs_core, vector_levels

core = _native.core()
pytestmark = needs_core


def bits(block: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(block).view(f"u{block.itemsize}")


def one_chunk(chunk: bytes, block: np.ndarray, tokens: int | None = None, start: int = 0, raw_xxh3: int | None = None) -> Chunks:
    """The batch record of one exphuff chunk of ``block``."""
    one = np.zeros(1, np.int64)
    raw = xxhash.xxh3_64_intdigest(bits(block).tobytes()) if raw_xxh3 is None else raw_xxh3
    return Chunks(one, np.array([len(chunk)]), np.array([xxhash.xxh3_64_intdigest(chunk)], np.uint64),
                  np.array([raw], np.uint64), np.zeros(1, bool), np.array([block.shape[1] if tokens is None else tokens]),
                  one, np.array([start]))


def scattered_rows(rng: np.random.Generator, count: int, row: int) -> np.ndarray:
    """Byte offsets for `count` rows of `row` bytes: shuffled slots at an odd shift, some rows left out (-1), some
    written where an earlier row went, some half over another."""
    slots = rng.permutation(count + 2)[:count]
    offsets = slots * row + 3
    kind = rng.random(count)
    offsets[kind < 0.1] = -1
    again = (kind >= 0.1) & (kind < 0.2)
    offsets[again] = rng.choice(offsets[~again], size=int(again.sum())) if (~again).any() else -1
    half = (kind >= 0.2) & (kind < 0.25) & (offsets >= row // 2)
    offsets[half] -= row // 2  # still inside the buffer: half over the slot before
    return offsets.astype(np.int64)


def placed(block: np.ndarray, offsets: np.ndarray, size: int) -> np.ndarray:
    """What writing the block's rows to `offsets` one after another leaves in a zeroed buffer of `size` bytes."""
    rows = bits(block).reshape(-1, block.shape[2]).view(np.uint8)
    out = np.zeros(size, np.uint8)
    for r, at in enumerate(offsets.tolist()):
        if at >= 0:
            out[at : at + rows.shape[1]] = rows[r]
    return out


@pytest.mark.parametrize("size", [0, 1, 16, 17, 128, 129, 240, 241, 300, 1024, 1025, 1029, 2048, 4157, 5000, 100_003])
def test_xxh3_in_pieces_is_xxh3(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    for level in vector_levels():
        for piece in (0, 1, 7, 63, 64, 65, 128, 384, 1000, 1024, 4096):
            assert core.xxh3_64(data, piece) == xxhash.xxh3_64_intdigest(data), (level, piece)


@settings(max_examples=150, deadline=None)
@given(float_blocks(kinds=("kv", "bits", "few", "special")), st.sampled_from([0, 16, 64]))
def test_every_level_decodes_like_the_reference(case, lane):
    name, block = case
    chunk = lanes_reference.encode(block, name, lane) if lane else reference.encode(block, name)
    for level in vector_levels():
        out = np.zeros(block.shape, f"u{block.itemsize}")
        assert core.exphuff_decode(chunk, out.reshape(-1).view(np.uint8), _native.DTYPE_CODES[name], *block.shape) == 0
        assert np.array_equal(out, bits(block)), level


@settings(max_examples=150, deadline=None)
@given(float_blocks(kinds=("kv", "bits", "few", "special")), st.integers(0, 2**32 - 1))
def test_rows_in_any_order_get_the_reference_values(case, seed):
    """Rows shuffled, left out, written twice or half over each other: each lands as if copied in row order."""
    name, block = case
    heads, tokens, dim = block.shape
    if not block.size:
        return
    chunk, row = reference.encode(block, name), dim * block.itemsize
    offsets = scattered_rows(np.random.default_rng(seed), heads * tokens, row)
    size = (heads * tokens + 2) * row + 3
    for level in vector_levels():
        target = np.zeros(size, np.uint8)
        batch = BatchCodec.of(DTYPES[name], coded=True)
        batch.decode_rows(chunk, one_chunk(chunk, block), np.zeros(1, np.int64), offsets, [target], heads, dim)
        assert np.array_equal(target, placed(block, offsets, size)), level


@pytest.mark.parametrize("start", [-5, 0, 7])
def test_blocks_clipped_to_the_tensor_at_every_level(samples, start):
    cache = KVCache.load(samples[0], layers=[3], tokens=slice(0, 200))
    block = cache.keys[0]
    heads, tokens, dim = block.shape
    chunk = reference.encode(block, "bf16")
    expected = np.zeros((1, heads, 180, dim), np.uint16)
    lo, hi = max(start, 0), min(start + tokens, 180)
    expected[0, :, lo:hi] = bits(block)[:, lo - start : hi - start]
    for level in vector_levels():
        out = np.zeros((1, heads, 180, dim), block.dtype)
        BatchCodec.of(block.dtype, coded=True).decode(chunk, one_chunk(chunk, block, start=start), out)
        assert np.array_equal(bits(out), expected), level


def test_real_rows_in_paged_blocks_at_every_level(samples):
    """A real cache's blocks into shuffled pages of 16 tokens: many row groups and runs per chunk."""
    cache = KVCache.load(samples[1], layers=[0, 17], tokens=slice(0, 256))
    heads, tokens, dim = cache.keys[0].shape
    row = dim * 2
    pages = np.random.default_rng(5).permutation(tokens // 16 + 3)[: tokens // 16]
    t = np.arange(tokens)
    offsets = ((pages[t // 16] * heads * 16 + t % 16)[None, :] + np.arange(heads)[:, None] * 16) * row
    for block in cache.keys + cache.values:
        chunk = reference.encode(block, "bf16")
        size = (len(pages) + 3) * heads * 16 * row
        for level in vector_levels():
            target = np.zeros(size, np.uint8)
            BatchCodec.of(block.dtype, coded=True).decode_rows(chunk, one_chunk(chunk, block), np.zeros(1, np.int64),
                                                               offsets.reshape(-1), [target], heads, dim)
            assert np.array_equal(target, placed(block, offsets.reshape(-1), size)), level


def test_a_wrong_raw_checksum_is_still_caught(samples):
    """The rows are written before their hash is known; a mismatch still fails the restore, whatever the level."""
    block = KVCache.load(samples[0], layers=[1], tokens=slice(0, 64)).values[0]
    heads, tokens, dim = block.shape
    chunk = reference.encode(block, "bf16")
    wrong = one_chunk(chunk, block, raw_xxh3=xxhash.xxh3_64_intdigest(bits(block).tobytes()) ^ 1)
    rows = np.arange(heads * tokens, dtype=np.int64) * dim * 2
    for level in vector_levels():
        batch = BatchCodec.of(block.dtype, coded=True)
        with pytest.raises(ChunkDecodeError) as rows_error:
            batch.decode_rows(chunk, wrong, np.zeros(1, np.int64), rows, [np.zeros(block.nbytes, np.uint8)], heads, dim)
        with pytest.raises(ChunkDecodeError) as arena_error:
            batch.decode(chunk, wrong, np.zeros((1, *block.shape), block.dtype))
        assert rows_error.value.reason == arena_error.value.reason == "checksum", level


def test_the_level_is_capped_never_raised_past_the_cpu():
    """One level for every kernel: a cap at any level this process runs is the level in use, and no cap runs the
    CPU's best, never above it."""
    before = core.isa()
    try:
        best = core.isa(len(_native.ISAS))
        assert before <= best < len(_native.ISAS)
        for level in range(best + 1):
            assert core.isa(level) == level and _native.isa_here() == _native.ISAS[level]
    finally:
        core.isa(before)


def test_the_scalar_kernels_can_be_forced():
    """KVTOOL_SIMD=scalar holds every kernel to portable C, which reads what the reference wrote."""
    script = (
        "import numpy as np; from kvtool import _native; from kvtool._native import reference;"
        "b = (np.random.default_rng(0).standard_normal((2, 50, 24)) * 3).astype(np.float32);"
        "c = reference.encode(b, 'fp32'); o = np.zeros_like(b);"
        "s = _native.core().exphuff_decode(c, o.reshape(-1).view(np.uint8), 2, *b.shape);"
        "print(_native.status(), s, o.tobytes() == b.tobytes())"
    )
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "KVTOOL_SIMD": "scalar"},
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["native", "(C,", "scalar", "kernels)", "0", "True"]
