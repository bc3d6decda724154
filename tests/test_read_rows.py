"""Decoding straight into memory laid out otherwise, row by row: an engine's paged KV blocks."""

from __future__ import annotations

import numpy as np
import pytest

from kvtool.cache import KVCache
from kvtool.kvz import KvzCorruptError, KvzReader, encode_cache
from kvtool.errors import UsageError

BLOCK = 16


def paged_rows(pages: np.ndarray, block_ids: np.ndarray, tokens: int, kind: int) -> np.ndarray:
    """Byte offsets [heads, tokens] of each token row of K (kind 0) or V (kind 1) in a CPU-style paged
    layer ``[num_blocks, heads, 2 * BLOCK, dim]`` (each block: its key rows, then its value rows)."""
    _, heads, _, dim = pages.shape
    t = np.arange(tokens)
    block, slot = block_ids[t // BLOCK], t % BLOCK + kind * BLOCK
    elems = block[None, :] * pages.strides[0] + np.arange(heads)[:, None] * pages.strides[1] + slot[None, :] * pages.strides[2]
    return elems.astype(np.int64)


@pytest.mark.parametrize("recipe", ["exphuff", "ctxtans", "none", "zstd:3", "ctxans", "channel-major|byteplane|zstd:1"])
def test_rows_land_in_their_paged_blocks(samples, recipe):
    cache = KVCache.load(samples[0], layers=[0, 5, 9], tokens=slice(0, 96))
    heads, tokens, dim = cache.keys[0].shape
    rng = np.random.default_rng(3)
    pages = [np.zeros((40, heads, 2 * BLOCK, dim), cache.dtype.numpy) for _ in cache.layer_ids]
    block_ids = rng.choice(40, size=tokens // BLOCK, replace=False)
    rows = np.stack([paged_rows(pages[i // 2], block_ids, tokens, i % 2) for i in range(2 * len(pages))])
    with KvzReader.from_bytes(encode_cache(cache, recipe, chunk_tokens=64)) as reader:
        reader.read_rows(pages, rows, [i // 2 for i in range(2 * len(pages))])
    for layer, page in enumerate(pages):
        for kind, expected in ((0, cache.keys[layer]), (1, cache.values[layer])):
            got = page[block_ids][:, :, kind * BLOCK : (kind + 1) * BLOCK]  # [blocks, heads, BLOCK, dim]
            got = got.transpose(1, 0, 2, 3).reshape(heads, tokens, dim)
            assert np.array_equal(got.view(np.uint16), expected.view(np.uint16))
    untouched = np.setdiff1d(np.arange(40), block_ids)
    assert not any(page[untouched].view(np.uint16).any() for page in pages)


@pytest.mark.parametrize("recipe", ["int:4,group=64|zstd:3", "fp8:e4m3|exphuff"])
def test_lossy_rows_are_what_a_read_restores(samples, recipe):
    """A lossy entry restores into paged blocks exactly as ``read`` restores it (no cache in between)."""
    cache = KVCache.load(samples[0], layers=[0, 5], tokens=slice(0, 80))
    heads, tokens, dim = cache.keys[0].shape
    target = np.zeros((4, heads, tokens, dim), cache.dtype.numpy)
    rows = (np.arange(4 * heads * tokens, dtype=np.int64) * dim * 2).reshape(4, heads, tokens)
    with KvzReader.from_bytes(encode_cache(cache, recipe, chunk_tokens=32)) as reader:
        reader.read_rows([target], rows, [0] * 4)
        restored = reader.read()
    expected = np.stack([a for _, _, a in restored.tensors()])
    assert np.array_equal(target.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("recipe", ["exphuff", "zstd:3"])
def test_negative_offsets_leave_rows_out(samples, recipe):
    cache = KVCache.load(samples[0], layers=[0], tokens=slice(0, 48))
    heads, tokens, dim = cache.keys[0].shape
    target = np.zeros((2, heads, tokens, dim), cache.dtype.numpy)
    rows = (np.arange(2 * heads * tokens, dtype=np.int64) * dim * 2).reshape(2, heads, tokens)
    rows[:, :, :16] = -1  # the first 16 tokens are already in place
    with KvzReader.from_bytes(encode_cache(cache, recipe, chunk_tokens=32)) as reader:
        reader.read_rows([target], rows, [0, 0])
    assert not target[:, :, :16].view(np.uint16).any()
    assert np.array_equal(target[0, :, 16:].view(np.uint16), cache.keys[0][:, 16:].view(np.uint16))
    assert np.array_equal(target[1, :, 16:].view(np.uint16), cache.values[0][:, 16:].view(np.uint16))


@pytest.mark.parametrize("shift", [0, 2, 3])
def test_rows_at_any_byte_offset(samples, shift):
    """Offsets need not be whole rows apart (the codecs without a batch path place such rows byte by byte)."""
    cache = KVCache.load(samples[0], layers=[0], tokens=slice(0, 40))
    heads, tokens, dim = cache.keys[0].shape
    row_bytes = dim * 2
    target = np.zeros(2 * heads * tokens * row_bytes + 8, np.uint8)
    rows = (np.arange(2 * heads * tokens, dtype=np.int64) * row_bytes + shift).reshape(2, heads, tokens)
    with KvzReader.from_bytes(encode_cache(cache, "zstd:3", chunk_tokens=32)) as reader:
        reader.read_rows([target], rows, [0, 0])
    placed = target[shift : shift + 2 * heads * tokens * row_bytes].view(np.uint16).reshape(2, heads, tokens, dim)
    assert np.array_equal(placed[0], cache.keys[0].view(np.uint16))
    assert np.array_equal(placed[1], cache.values[0].view(np.uint16))
    assert not target[:shift].any() and not target[shift + 2 * heads * tokens * row_bytes :].any()


def test_offsets_outside_the_target_are_refused(samples):
    cache = KVCache.load(samples[0], layers=[0], tokens=slice(0, 32))
    heads, tokens, dim = cache.keys[0].shape
    target = np.zeros((heads, tokens, dim), cache.dtype.numpy)
    rows = np.zeros((2, heads, tokens), np.int64)
    rows[1, 0, 0] = target.nbytes - 1
    with KvzReader.from_bytes(encode_cache(cache)) as reader, pytest.raises(UsageError):
        reader.read_rows([target], rows, [0, 0])


def test_a_damaged_chunk_is_refused(samples):
    cache = KVCache.load(samples[0], layers=[0], tokens=slice(0, 32))
    heads, tokens, dim = cache.keys[0].shape
    blob = bytearray(encode_cache(cache))
    blob[len(blob) // 2] ^= 4
    target = np.zeros((2, heads, tokens, dim), cache.dtype.numpy)
    rows = (np.arange(2 * heads * tokens, dtype=np.int64) * dim * 2).reshape(2, heads, tokens)
    with KvzReader.from_bytes(bytes(blob)) as reader, pytest.raises(KvzCorruptError):
        reader.read_rows([target], rows, [0, 0])
