"""Hypothesis strategies for float KV blocks, bit patterns included: shared by the native-core tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from kvtool._native import reference
from kvtool.testing.arraycodecs import DTYPES

#: Bit patterns of each family that decoders get wrong first: signed zeros, the smallest and
#: largest subnormals, infinities, quiet and signalling NaNs, the largest finite values.
SPECIAL_BITS = {
    "bf16": [0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC0, 0xFF81, 0x7F7F, 0xFF7F],
    "fp16": [0x0000, 0x8000, 0x0001, 0x83FF, 0x7C00, 0xFC00, 0x7E00, 0xFC01, 0x7BFF, 0xFBFF],
    "fp32": [0, 0x80000000, 1, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFF800001, 0x7F7FFFFF],
    "fp8_e4m3": [0x00, 0x80, 0x01, 0x87, 0x7F, 0xFF, 0x7E, 0xFE],
    "fp8_e5m2": [0x00, 0x80, 0x01, 0x83, 0x7C, 0xFC, 0x7E, 0xFD, 0x7B],
}


def any_bits(rng: np.random.Generator, name: str, shape) -> np.ndarray:
    """A block of any bit patterns at all, viewed as dtype `name`."""
    width = reference.FAMILIES[name].width
    bits = rng.integers(0, 1 << (8 * width), size=shape, dtype=np.uint64).astype(f"u{width}")
    return bits.view(DTYPES[name])


def kv_values(rng: np.random.Generator, shape, few: bool = False) -> np.ndarray:
    """KV-like float64 values: normal, one scale per head and channel; `few` rounds them to a handful of
    distinct values (one- and two-symbol codes)."""
    scale = np.exp(rng.normal(0, 2, size=(shape[0], 1, shape[2])))
    values = rng.standard_normal(shape) * scale
    return np.round(values) if few else values


@st.composite
def float_blocks(draw, dtypes=tuple(reference.FAMILIES), max_heads=3, max_tokens=40, max_dim=20,
                 kinds=("kv", "bits", "few", "special")):
    """(dtype name, block): KV-like values, any bit pattern, a few distinct values, or KV-like values
    sprinkled with special patterns; shapes include empty and odd ones."""
    name = draw(st.sampled_from(list(dtypes)))
    shape = (draw(st.integers(0, max_heads)), draw(st.integers(0, max_tokens)), draw(st.integers(0, max_dim)))
    kind = draw(st.sampled_from(list(kinds)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "bits":
        return name, any_bits(rng, name, shape)
    block = kv_values(rng, shape, few=kind == "few").astype(np.float32).astype(DTYPES[name])
    if kind == "special" and block.size:
        width = reference.FAMILIES[name].width
        bits = block.view(f"u{width}").copy()
        where = rng.random(shape) < draw(st.sampled_from([0.05, 0.5, 1.0]))
        bits[where] = rng.choice(np.array(SPECIAL_BITS[name], dtype=f"u{width}"), size=int(where.sum()))
        block = bits.view(DTYPES[name])
    return name, block


@st.composite
def blocks_with_repeats(draw):
    """Blocks of every dtype and many shapes: KV-like values, any bit patterns, few distinct values,
    and rows repeated from earlier tokens (the context coders' repeat model), in geometries on and off
    their fast paths (dim a multiple of 8)."""
    name = draw(st.sampled_from(list(reference.FAMILIES)))
    shape = (draw(st.integers(0, 4)), draw(st.integers(0, 40)), draw(st.sampled_from([0, 1, 3, 8, 16, 20])))
    kind = draw(st.sampled_from(["kv", "bits", "few", "rows"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "bits":
        return name, any_bits(rng, name, shape)
    block = kv_values(rng, shape, few=kind == "few").astype(DTYPES[name])
    if kind == "rows" and shape[1] > 1:
        for t in rng.integers(1, shape[1], size=shape[1] // 2):
            block[:, t] = block[:, rng.integers(0, t)]
    return name, block
