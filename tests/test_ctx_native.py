"""The ctxans C core against its numpy reference: the same chunks, both ways, on real and generated blocks."""

from __future__ import annotations


import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool import _native
from kvtool.cache import KVCache
from kvtool.codecs import get_codec
from kvtool.modeldict import ctxans_reference as reference
from kvtool.modeldict import format as dict_format

from float_blocks import blocks_with_repeats
from native_checks import (
    needs_core, CorePaths, assert_same_answer_to_damage, assert_same_chunks, assert_same_file_without_the_core, sample_blocks,
)

core = _native.core()
CODEC = get_codec("ctxans")
DICTIONARY = CODEC.dictionary()
TABLES = DICTIONARY.tables


def native_encode(block: np.ndarray, name: str) -> bytes:
    _, model = CODEC._loaded()
    contiguous = np.ascontiguousarray(block)
    return core.ctxans_encode(contiguous.reshape(-1).view(np.uint8), model, _native.DTYPE_CODES[name], *block.shape)


def native_decode(chunk: bytes, name: str, shape) -> tuple[int, np.ndarray]:
    _, model = CODEC._loaded()
    out = np.zeros(shape, f"u{reference.FAMILIES[name].width}")
    status = core.ctxans_decode(chunk, out.reshape(-1).view(np.uint8), model, _native.DTYPE_CODES[name], *shape)
    return status, out


def reference_encode(block: np.ndarray, name: str) -> bytes:
    return reference.encode(block, name, TABLES, DICTIONARY.tag)


def reference_decode(chunk: bytes, name: str, shape) -> np.ndarray:
    return reference.decode(chunk, name, shape, TABLES, DICTIONARY.tag)


PATHS = CorePaths(native_encode, native_decode, reference_encode, reference_decode)


@needs_core
@settings(max_examples=300, deadline=None)
@given(blocks_with_repeats())
def test_native_and_reference_write_and_read_the_same_chunks(case):
    assert_same_chunks(PATHS, *case)


@needs_core
@settings(max_examples=200, deadline=None)
@given(blocks_with_repeats(), st.data())
def test_native_and_reference_reject_the_same_damage(case, data):
    """A damaged chunk is refused by both decoders, or decoded by both to the same values."""
    assert_same_answer_to_damage(PATHS, *case, data)


@needs_core
def test_real_samples_match_in_every_dtype(samples):
    for name, block in sample_blocks(samples[1]):
        assert native_encode(block, name) == reference_encode(block, name)


def test_repeated_rows_are_named_not_coded(samples):
    """Layer 0's values are a function of the token alone: its repeated rows shrink the chunk."""
    values = KVCache.load(samples[0], layers=[0]).values[0]
    chunk = CODEC.encode_array(values)
    assert chunk[1] & reference.FLAG_REPEATS
    assert len(chunk) < 0.5 * values.nbytes
    keys_chunk = CODEC.encode_array(KVCache.load(samples[0], layers=[0]).keys[0])
    assert not keys_chunk[1] & reference.FLAG_REPEATS


def test_files_are_the_same_without_the_core(samples):
    """The whole .kvz, written and read with the core and with the reference path only."""
    assert_same_file_without_the_core(samples[0], "ctxans", [0, 3])


@needs_core
def test_the_core_is_built_with_the_formats_constants_and_refused_with_others(monkeypatch):
    assert core.CTXANS_CONSTANTS == reference.NATIVE_CONSTANTS
    for name in ("SYMBOLS", "LEVELS", "LOW", "PROB_BITS", "REF_SYMBOLS", "MAX_CLASSES", "MAX_CONTEXTS"):
        assert reference.NATIVE_CONSTANTS[name] == getattr(dict_format, name)  # what .kvd dictionaries are made of
    monkeypatch.delenv("KVTOOL_NATIVE", raising=False)
    assert _native._load.__wrapped__()[0] is core
    monkeypatch.setitem(reference.NATIVE_CONSTANTS, "LOW", reference.LOW + 1)
    module, reason = _native._load.__wrapped__()
    assert module is None and "other sources" in reason
