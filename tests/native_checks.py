"""Checks every native codec shares with its numpy reference: the same chunks both ways, the same answer
to damage, and the same whole file with the native core turned off."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import pytest

from kvtool import _native
from kvtool.cache import KVCache
from kvtool.errors import DecodeError
from kvtool.kvz import decode_cache, encode_cache
from kvtool.testing.arraycodecs import DTYPES


#: For tests that compare the core with its reference: skipped only where no core is built (CI builds it).
needs_core = pytest.mark.skipif(_native.core() is None, reason=f"native core: {_native.status()}")


def levels_here() -> range:
    """The core's vector levels (indexes of ``_native.ISAS``) this process may run: every one up to the level in use,
    which is the CPU's best unless KVTOOL_SIMD holds it lower; the scalar one everywhere."""
    return range(_native.core().isa() + 1)


@contextmanager
def at_level(level: int) -> Iterator[None]:
    """Every kernel of the core runs at vector level `level` (one of ``levels_here()``) inside; the level before is
    restored after."""
    core = _native.core()
    before = core.isa()
    try:
        assert core.isa(level) == level, f"this process cannot run {_native.ISAS[level]} kernels"
        yield
    finally:
        core.isa(before)


def vector_levels() -> Iterator[str]:
    """Runs the caller's loop body once at each of ``levels_here()``, naming it."""
    for level in levels_here():
        with at_level(level):
            yield _native.ISAS[level]


@dataclass(frozen=True)
class CorePaths:
    """One codec's chunk coders: the C core's (decode returns its status and the bits) and the reference's."""

    native_encode: Callable[[np.ndarray, str], bytes]
    native_decode: Callable[[bytes, str, tuple], tuple[int, np.ndarray]]
    reference_encode: Callable[[np.ndarray, str], bytes]
    reference_decode: Callable[[bytes, str, tuple], np.ndarray]


def assert_same_chunks(paths: CorePaths, name: str, block: np.ndarray) -> None:
    """Both encoders write the same chunk, and both decoders read it back to the block's bits."""
    chunk = paths.native_encode(block, name)
    assert chunk == paths.reference_encode(block, name)
    status, out = paths.native_decode(chunk, name, block.shape)
    assert status == 0
    expected = np.ascontiguousarray(block).view(f"u{block.itemsize}")
    assert np.array_equal(out, expected)
    assert np.array_equal(paths.reference_decode(chunk, name, block.shape), expected)


def assert_same_answer_to_damage(paths: CorePaths, name: str, block: np.ndarray, data) -> None:
    """A chunk with one bit flipped and maybe cut short is refused by both decoders, or decoded by both
    to the same values; `data` is hypothesis's draw of where."""
    from hypothesis import strategies as st

    chunk = bytearray(paths.native_encode(block, name))
    if not chunk:
        return
    pos = data.draw(st.integers(0, len(chunk) - 1))
    chunk[pos] ^= 1 << data.draw(st.integers(0, 7))
    cut = data.draw(st.sampled_from([len(chunk), max(0, len(chunk) - 1), len(chunk) // 2]))
    damaged = bytes(chunk[:cut])
    status, out = paths.native_decode(damaged, name, block.shape)
    try:
        ref = paths.reference_decode(damaged, name, block.shape)
    except DecodeError:
        assert status != 0
        return
    assert status == 0 and np.array_equal(out, ref)


def assert_same_file_without_the_core(sample, codec: str, layers: list[int]) -> None:
    """The whole .kvz of 90 tokens of `layers`, written in a process with the core and in one with the
    reference path only, is the same file as this process writes, and reads back to the cache's bits."""
    script = (
        "import sys, hashlib; from kvtool.cache import KVCache; from kvtool.kvz import encode_cache;"
        f"c = KVCache.load(sys.argv[1], layers={layers!r}, tokens=slice(0, 90));"
        f"print(hashlib.sha256(encode_cache(c, {codec!r}, chunk_tokens=32)).hexdigest())"
    )

    def run(env):
        return subprocess.run([sys.executable, "-c", script, str(sample)], env={**os.environ, **env},
                              capture_output=True, text=True, check=True)

    native, plain = run({}), run({"KVTOOL_NATIVE": "0"})
    assert native.stdout == plain.stdout
    cache = KVCache.load(sample, layers=layers, tokens=slice(0, 90))
    blob = encode_cache(cache, codec, chunk_tokens=32)
    assert hashlib.sha256(blob).hexdigest() == native.stdout.strip()
    assert decode_cache(blob).equal_bits(cache)


def sample_blocks(sample):
    """(dtype name, block): the first 100 tokens of layers 0, 13 and 29 of a real cache, keys and values,
    cast to every dtype kvtool codes."""
    cache = KVCache.load(sample, layers=[0, 13, 29])
    for name, dtype in DTYPES.items():
        for array in cache.keys + cache.values:
            yield name, array.astype(np.float32).astype(dtype)[:, :100]
