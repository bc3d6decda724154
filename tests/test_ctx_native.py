"""The ctxans C core against its numpy reference: the same chunks, both ways, on real and generated blocks."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool import _native
from kvtool.cache import KVCache
from kvtool.codecs import get_codec
from kvtool.kvz import decode_cache, encode_cache
from kvtool.errors import DecodeError
from kvtool.modeldict import ctxans_reference as reference
from kvtool.modeldict import format as dict_format
from kvtool.testing.arraycodecs import DTYPES

core = _native.core()
needs_core = pytest.mark.skipif(core is None, reason=f"native core: {_native.status()}")
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


@st.composite
def blocks(draw):
    """Blocks of every dtype and many shapes: KV-like values, any bit patterns, few distinct values,
    and rows repeated from earlier tokens (the repeat model), in geometries on and off the fast paths."""
    name = draw(st.sampled_from(list(reference.FAMILIES)))
    shape = (draw(st.integers(0, 4)), draw(st.integers(0, 40)), draw(st.sampled_from([0, 1, 3, 8, 16, 20])))
    kind = draw(st.sampled_from(["kv", "bits", "few", "rows"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    width = reference.FAMILIES[name].width
    if kind == "bits":
        bits = rng.integers(0, 1 << (8 * width), size=shape, dtype=np.uint64).astype(f"u{width}")
        return name, bits.view(DTYPES[name])
    scale = np.exp(rng.normal(0, 2, size=(shape[0], 1, shape[2])))
    values = rng.standard_normal(shape) * scale
    if kind == "few":
        values = np.round(values)
    block = values.astype(DTYPES[name])
    if kind == "rows" and shape[1] > 1:
        for t in rng.integers(1, shape[1], size=shape[1] // 2):
            block[:, t] = block[:, rng.integers(0, t)]
    return name, block


@needs_core
@settings(max_examples=300, deadline=None)
@given(blocks())
def test_native_and_reference_write_and_read_the_same_chunks(case):
    name, block = case
    chunk = native_encode(block, name)
    assert chunk == reference_encode(block, name)
    status, out = native_decode(chunk, name, block.shape)
    assert status == 0
    expected = np.ascontiguousarray(block).view(f"u{block.itemsize}")
    assert np.array_equal(out, expected)
    assert np.array_equal(reference_decode(chunk, name, block.shape), expected)


@needs_core
@settings(max_examples=200, deadline=None)
@given(blocks(), st.data())
def test_native_and_reference_reject_the_same_damage(case, data):
    """A damaged chunk is refused by both decoders, or decoded by both to the same values."""
    name, block = case
    chunk = bytearray(native_encode(block, name))
    pos = data.draw(st.integers(0, len(chunk) - 1))
    chunk[pos] ^= 1 << data.draw(st.integers(0, 7))
    cut = data.draw(st.sampled_from([len(chunk), max(0, len(chunk) - 1), len(chunk) // 2]))
    damaged = bytes(chunk[:cut])
    status, out = native_decode(damaged, name, block.shape)
    try:
        ref = reference_decode(damaged, name, block.shape)
    except DecodeError:
        assert status != 0
        return
    assert status == 0 and np.array_equal(out, ref)


@needs_core
def test_real_samples_match_in_every_dtype(samples):
    cache = KVCache.load(samples[1], layers=[0, 13, 29])
    for name, dtype in DTYPES.items():
        for array in cache.keys + cache.values:
            block = array.astype(np.float32).astype(dtype)[:, :100]
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
    script = (
        "import sys, hashlib; from kvtool.cache import KVCache; from kvtool.kvz import encode_cache;"
        "c = KVCache.load(sys.argv[1], layers=[0, 3], tokens=slice(0, 90));"
        "print(hashlib.sha256(encode_cache(c, 'ctxans', chunk_tokens=32)).hexdigest())"
    )
    run = lambda env: subprocess.run(  # noqa: E731
        [sys.executable, "-c", script, str(samples[0])], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    native, plain = run({}), run({"KVTOOL_NATIVE": "0"})
    assert native.stdout == plain.stdout
    cache = KVCache.load(samples[0], layers=[0, 3], tokens=slice(0, 90))
    blob = encode_cache(cache, "ctxans", chunk_tokens=32)
    assert hashlib.sha256(blob).hexdigest() == native.stdout.strip()
    assert decode_cache(blob).equal_bits(cache)


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
