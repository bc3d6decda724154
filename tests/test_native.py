"""The native core against its numpy reference: the same bytes, both ways, on real and generated blocks."""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool import _native
from kvtool._native import reference
from kvtool.cache import KVCache
from kvtool.kvz import decode_cache, encode_cache
from kvtool.errors import DecodeError
from kvtool.testing.arraycodecs import DTYPES

core = _native.core()
needs_core = pytest.mark.skipif(core is None, reason=f"native core: {_native.status()}")


def native_encode(block: np.ndarray, name: str) -> bytes:
    contiguous = np.ascontiguousarray(block)
    return core.exphuff_encode(contiguous.reshape(-1).view(np.uint8), _native.DTYPE_CODES[name], *block.shape)


def native_decode(chunk: bytes, name: str, shape) -> tuple[int, np.ndarray]:
    out = np.zeros(shape, f"u{reference.FAMILIES[name].width}")
    status = core.exphuff_decode(chunk, out.reshape(-1).view(np.uint8), _native.DTYPE_CODES[name], *shape)
    return status, out


@st.composite
def blocks(draw):
    name = draw(st.sampled_from(list(reference.FAMILIES)))
    shape = (draw(st.integers(0, 3)), draw(st.integers(0, 40)), draw(st.integers(0, 20)))
    kind = draw(st.sampled_from(["kv", "bits", "few"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    width = reference.FAMILIES[name].width
    if kind == "bits":  # any bit pattern at all
        bits = rng.integers(0, 1 << (8 * width), size=shape, dtype=np.uint64).astype(f"u{width}")
        return name, bits.view(DTYPES[name])
    scale = np.exp(rng.normal(0, 2, size=(shape[0], 1, shape[2])))
    values = rng.standard_normal(shape) * scale
    if kind == "few":  # a handful of distinct values: one- and two-symbol codes
        values = np.round(values)
    return name, values.astype(DTYPES[name])


@needs_core
@settings(max_examples=300, deadline=None)
@given(blocks())
def test_native_and_reference_write_and_read_the_same_chunks(case):
    name, block = case
    chunk = native_encode(block, name)
    assert chunk == reference.encode(block, name)
    status, out = native_decode(chunk, name, block.shape)
    assert status == 0
    expected = np.ascontiguousarray(block).view(f"u{block.itemsize}")
    assert np.array_equal(out, expected)
    assert np.array_equal(reference.decode(chunk, name, block.shape), expected)


@needs_core
@settings(max_examples=200, deadline=None)
@given(blocks(), st.data())
def test_native_and_reference_reject_the_same_damage(case, data):
    """A damaged chunk is refused by both decoders, or decoded by both to the same values."""
    name, block = case
    chunk = bytearray(native_encode(block, name))
    if not chunk:
        return
    pos = data.draw(st.integers(0, len(chunk) - 1))
    chunk[pos] ^= 1 << data.draw(st.integers(0, 7))
    cut = data.draw(st.sampled_from([len(chunk), max(0, len(chunk) - 1), len(chunk) // 2]))
    damaged = bytes(chunk[:cut])
    status, out = native_decode(damaged, name, block.shape)
    try:
        ref = reference.decode(damaged, name, block.shape)
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
            assert native_encode(block, name) == reference.encode(block, name)


@needs_core
@pytest.mark.parametrize("size", [0, 1, 3, 4, 8, 9, 16, 17, 100, 128, 129, 200, 240, 241, 1024, 1025, 2048, 5000, 100_003])
def test_native_xxh3_is_xxh3(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert core.xxh3_64(data) == xxhash.xxh3_64_intdigest(data)


def test_files_are_the_same_without_the_core(samples, tmp_path):
    """The whole .kvz, written and read with the core and with the reference path only."""
    script = (
        "import sys, hashlib; from kvtool.cache import KVCache; from kvtool.kvz import encode_cache;"
        "c = KVCache.load(sys.argv[1], layers=[2, 3], tokens=slice(0, 90));"
        "print(hashlib.sha256(encode_cache(c, 'exphuff', chunk_tokens=32)).hexdigest())"
    )
    run = lambda env: subprocess.run(  # noqa: E731
        [sys.executable, "-c", script, str(samples[0])], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    native, plain = run({}), run({"KVTOOL_NATIVE": "0"})
    assert native.stdout == plain.stdout
    cache = KVCache.load(samples[0], layers=[2, 3], tokens=slice(0, 90))
    assert decode_cache(encode_cache(cache, "exphuff", chunk_tokens=32)).equal_bits(cache)


def test_reference_path_warns_when_the_core_is_missing():
    script = "import warnings, kvtool._native as n; n._load.cache_clear(); print(n.status())"
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "KVTOOL_NATIVE": "0"},
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("numpy reference")
