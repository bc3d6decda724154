"""The native core against its numpy reference: the same bytes, both ways, on real and generated blocks."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool import _native
from kvtool._native import reference
from kvtool._native.core_api import NativeCore

from float_blocks import float_blocks
from native_checks import (
    needs_core, CorePaths, assert_same_answer_to_damage, assert_same_chunks, assert_same_file_without_the_core, sample_blocks,
)

core = _native.core()


def native_encode(block: np.ndarray, name: str) -> bytes:
    contiguous = np.ascontiguousarray(block)
    return core.exphuff_encode(contiguous.reshape(-1).view(np.uint8), _native.DTYPE_CODES[name], *block.shape)


def native_decode(chunk: bytes, name: str, shape) -> tuple[int, np.ndarray]:
    out = np.zeros(shape, f"u{reference.FAMILIES[name].width}")
    status = core.exphuff_decode(chunk, out.reshape(-1).view(np.uint8), _native.DTYPE_CODES[name], *shape)
    return status, out


PATHS = CorePaths(native_encode, native_decode, reference.encode, reference.decode)


@needs_core
@settings(max_examples=300, deadline=None)
@given(float_blocks(kinds=("kv", "bits", "few")))
def test_native_and_reference_write_and_read_the_same_chunks(case):
    assert_same_chunks(PATHS, *case)


@needs_core
@settings(max_examples=200, deadline=None)
@given(float_blocks(kinds=("kv", "bits", "few")), st.data())
def test_native_and_reference_reject_the_same_damage(case, data):
    """A damaged chunk is refused by both decoders, or decoded by both to the same values."""
    assert_same_answer_to_damage(PATHS, *case, data)


@needs_core
def test_real_samples_match_in_every_dtype(samples):
    for name, block in sample_blocks(samples[1]):
        assert native_encode(block, name) == reference.encode(block, name)


@needs_core
@pytest.mark.parametrize("size", [0, 1, 3, 4, 8, 9, 16, 17, 100, 128, 129, 200, 240, 241, 1024, 1025, 2048, 5000, 100_003])
def test_native_xxh3_is_xxh3(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert core.xxh3_64(data) == xxhash.xxh3_64_intdigest(data)


@needs_core
def test_the_typed_interface_names_what_the_core_exports():
    """``NativeCore``, which the type checker holds every call into C to, lists each function and constant of the
    extension and nothing else."""
    declared = {name for name in vars(NativeCore) if not name.startswith("_")} | set(NativeCore.__annotations__)
    assert declared == {name for name in dir(core) if not name.startswith("_")}


@needs_core
@pytest.mark.parametrize("name", sorted(name for name, member in vars(NativeCore).items() if inspect.isfunction(member)
                                        and not name.startswith("_")))
def test_the_typed_interface_takes_as_many_arguments_as_the_core(name):
    """Each function's C binding refuses one argument too few and one too many, as ``NativeCore`` declares them
    (``PyArg_ParseTuple`` counts the arguments before it reads any)."""
    params = list(inspect.signature(getattr(NativeCore, name)).parameters.values())[1:]
    required = sum(p.default is inspect.Parameter.empty for p in params)
    for count, bound in ((required - 1, required), (len(params) + 1, len(params))):
        if count < 0:
            continue
        with pytest.raises(TypeError, match=rf"takes (exactly|at least|at most) {bound} arguments? \({count} given\)"):
            getattr(core, name)(*[None] * count)


def test_files_are_the_same_without_the_core(samples):
    """The whole .kvz, written and read with the core and with the reference path only."""
    assert_same_file_without_the_core(samples[0], "exphuff", [2, 3])


def test_reference_path_warns_when_the_core_is_missing():
    script = "import warnings, kvtool._native as n; n._load.cache_clear(); print(n.status())"
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "KVTOOL_NATIVE": "0"},
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("numpy reference")
