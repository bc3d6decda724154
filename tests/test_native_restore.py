"""The core's restore kernels at every vector level this CPU has (the portable one everywhere): the checksum
hashed in pieces, exphuff decoded, equal to their references bit for bit."""

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

from float_blocks import float_blocks
from native_checks import needs_core, vector_levels

core = _native.core()
pytestmark = needs_core


def bits(block: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(block).view(f"u{block.itemsize}")


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


def test_the_portable_kernels_can_be_forced():
    """KVTOOL_NATIVE_ISA=portable holds every kernel to plain C, which reads what the reference wrote."""
    script = (
        "import numpy as np; from kvtool import _native; from kvtool._native import reference;"
        "b = (np.random.default_rng(0).standard_normal((2, 50, 24)) * 3).astype(np.float32);"
        "c = reference.encode(b, 'fp32'); o = np.zeros_like(b);"
        "s = _native.core().exphuff_decode(c, o.reshape(-1).view(np.uint8), 2, *b.shape);"
        "print(_native.status(), s, o.tobytes() == b.tobytes())"
    )
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "KVTOOL_NATIVE_ISA": "portable"},
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["native", "(C,", "portable)", "0", "True"]
