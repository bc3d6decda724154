"""The ctxtans codec: its C core against its numpy reference, both ways, on real and generated blocks;
its tables; its fallback to per-chunk statistics; whole files with and without the core."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool import _native
from kvtool._native import ctxtans_reference as reference
from kvtool._native.ctxtans_tables import TABLE_LOG, TABLE_SIZE, quantize
from kvtool.cache import KVCache
from kvtool.codecs import get_codec
from kvtool.codecs.ctxtans import tables_of
from kvtool.kvz import KvzReader, encode_cache
from kvtool.errors import DecodeError
from kvtool.modeldict.format import Dictionary

from float_blocks import blocks_with_repeats
from native_checks import (
    needs_core, CorePaths, assert_same_answer_to_damage, assert_same_chunks, assert_same_file_without_the_core, sample_blocks,
)

core = _native.core()
CODEC = get_codec("ctxtans")
DICTIONARY = CODEC.dictionary()
TABLES, MODEL = tables_of(DICTIONARY)


def native_encode(block: np.ndarray, name: str, model=None) -> bytes:
    contiguous = np.ascontiguousarray(block)
    return core.ctxtans_encode(contiguous.reshape(-1).view(np.uint8), model or MODEL, _native.DTYPE_CODES[name], *block.shape)


def native_decode(chunk: bytes, name: str, shape, model=None) -> tuple[int, np.ndarray]:
    out = np.zeros(shape, f"u{reference.FAMILIES[name].width}")
    status = core.ctxtans_decode(chunk, out.reshape(-1).view(np.uint8), model or MODEL, _native.DTYPE_CODES[name], *shape)
    return status, out


def reference_encode(block: np.ndarray, name: str) -> bytes:
    return reference.encode(block, name, TABLES, DICTIONARY.tag)


def reference_decode(chunk: bytes, name: str, shape) -> np.ndarray:
    return reference.decode(chunk, name, shape, TABLES, DICTIONARY.tag)


PATHS = CorePaths(native_encode, native_decode, reference_encode, reference_decode)


def test_tables_are_complete_tans_tables():
    """Every model sums to the table size, every state decodes to a used symbol and a state of the table,
    and the encode table inverts the decode table."""
    t = TABLES
    assert (t.g.sum(axis=1) == TABLE_SIZE).all()
    assert ((t.g > 0) == (TABLES.coder.freq > 0)).all()
    assert (np.take_along_axis(t.g, t.symbol, axis=1) > 0).all()
    assert ((t.base >> t.nbits << t.nbits) == t.base).all() and (t.base + (1 << t.nbits) <= TABLE_SIZE).all()
    for m in (0, 17, t.g.shape[0] - 1):
        states = t.encode[m]
        assert sorted(states.tolist()) == list(range(TABLE_SIZE))
        assert (np.repeat(np.arange(64), t.g[m]) == t.symbol[m, states]).all()


def test_quantize_keeps_every_symbol_and_the_sum():
    freq = np.zeros((3, 64), np.int64)
    freq[0] = 512  # uniform: every symbol 32
    freq[1, 0], freq[1, 1:] = (1 << 15) - 63, 1  # one big, the rest at the floor
    freq[2, :32] = 1024  # half the symbols unused
    g = quantize(freq)
    assert (g.sum(axis=1) == 1 << TABLE_LOG).all()
    assert (g[0] == 32).all() and (g[1, 1:] == 1).all() and g[1, 0] == TABLE_SIZE - 63
    assert (g[2, 32:] == 0).all() and (g[2, :32] == 64).all()


@needs_core
@settings(max_examples=300, deadline=None)
@given(blocks_with_repeats())
def test_native_and_reference_write_and_read_the_same_chunks(case):
    assert_same_chunks(PATHS, *case)


@needs_core
@settings(max_examples=100, deadline=None)
@given(blocks_with_repeats())
def test_chunks_of_the_first_version_still_decode(case):
    """Version 1 chunks (each head's channels in their own order, not by class) decode in both decoders."""
    name, block = case
    chunk = reference.encode(block, name, TABLES, DICTIONARY.tag, version=1)
    assert chunk[0] == 1
    expected = np.ascontiguousarray(block).view(f"u{block.itemsize}")
    status, out = native_decode(chunk, name, block.shape)
    assert status == 0 and np.array_equal(out, expected)
    assert np.array_equal(reference_decode(chunk, name, block.shape), expected)


def test_version_2_sorts_each_heads_channels_by_class():
    classes = np.array([3, 1, 3, 0, 2, 2, 0, 1])
    assert reference.coding_channels(classes, 4, 2).tolist() == [3, 1, 0, 2, 6, 7, 4, 5]
    assert reference.coding_channels(classes, 4, 1).tolist() == list(range(8))


@needs_core
@settings(max_examples=200, deadline=None)
@given(blocks_with_repeats(), st.data())
def test_native_and_reference_reject_the_same_damage(case, data):
    """A damaged chunk is refused by both decoders, or decoded by both to the same values."""
    assert_same_answer_to_damage(PATHS, *case, data)


@needs_core
def test_real_samples_match_in_every_dtype(samples):
    for name, block in sample_blocks(samples[1]):
        chunk = native_encode(block, name)
        assert chunk == reference_encode(block, name)
        if name == "bf16":  # the shipped dictionary was learnt from bf16 caches of this model
            assert chunk[1] == reference.MODE_DICT
        assert np.array_equal(native_decode(chunk, name, block.shape)[1], block.view(f"u{block.itemsize}"))


def test_it_codes_what_ctxans_codes_within_a_fraction_of_a_percent(samples):
    cache = KVCache.load(samples[0], layers=[2, 20])
    ctxans = get_codec("ctxans")
    for array in cache.keys + cache.values:
        ours, theirs = len(CODEC.encode_array(array)), len(ctxans.encode_array(array))
        assert theirs * 0.995 < ours < theirs * 1.005


def test_a_dictionary_that_does_not_fit_falls_back_to_the_chunks_own_statistics(samples):
    """A dictionary whose models say nothing (every symbol alike) codes worse than a Huffman code of the
    chunk: the chunk is an exphuff chunk, and the C core and the reference agree."""
    flat = np.full((1, 1, 64), 512, np.uint16)
    classes = np.zeros(64, np.uint16)
    classes[0] = 1 << 15
    useless = Dictionary(flat, np.zeros(64, np.uint8), 0, classes, np.full(32, 1024, np.uint16))
    tables, model = tables_of(useless)
    block = KVCache.load(samples[0], layers=[7]).keys[0][:, :64]
    chunk = reference.encode(block, "bf16", tables, useless.tag)
    assert chunk[:2] == bytes([reference.VERSION, reference.MODE_EXPHUFF])
    back = reference.decode(chunk, "bf16", block.shape, tables, useless.tag)
    assert np.array_equal(back, block.view(np.uint16))
    if core is not None:
        assert native_encode(block, "bf16", model) == chunk
        status, out = native_decode(chunk, "bf16", block.shape, model)
        assert status == 0 and np.array_equal(out, block.view(np.uint16))


def test_a_chunk_of_another_dictionary_is_refused(samples):
    block = KVCache.load(samples[0], layers=[3]).keys[0][:, :16]
    chunk = bytearray(reference_encode(block, "bf16"))
    chunk[4] ^= 0xFF  # the dictionary tag
    with pytest.raises(DecodeError, match="another dictionary|dictionary"):
        CODEC.decode_array(bytes(chunk), block.shape, block.dtype)


def test_files_are_the_same_without_the_core(samples):
    """The whole .kvz, written and read with the core and with the reference path only."""
    assert_same_file_without_the_core(samples[0], "ctxtans", [0, 3])


@needs_core
def test_the_batch_path_codes_it_with_the_same_bytes(samples):
    """Several chunks per native call (threads, GIL released) write and read what the per-chunk path does."""
    from kvtool.recipe import Recipe

    cache = KVCache.load(samples[1], layers=[0, 11, 29], tokens=slice(0, 200))
    batch = Recipe.parse("ctxtans").batch_kernel(cache.dtype.numpy)
    assert batch is not None and batch.model is not None
    blob, meta = batch.encode_tensor(cache.values[0], 64)
    chunks, at = [], 0
    for record in meta:
        chunks.append(blob[at : at + int(record["stored_len"])])
        at += int(record["stored_len"])
    expected = [reference_encode(cache.values[0][:, t : t + 64], "bf16") for t in range(0, 200, 64)]
    assert [c for c, r in zip(chunks, meta) if not r["flags"]] == [e for e, r in zip(expected, meta) if not r["flags"]]
    one, four = encode_cache(cache, "ctxtans", chunk_tokens=64, threads=1), encode_cache(cache, "ctxtans", chunk_tokens=64, threads=4)
    assert one == four
    with KvzReader.from_bytes(one) as reader:
        assert reader.read(threads=4).equal_bits(cache)
