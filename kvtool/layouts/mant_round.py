"""``mant-round:N``: each value rounded to N mantissa bits, to nearest, ties to even (lossy).

The plane keeps its dtype and shape; the low mantissa bits become zero, which
the lossless stages after it can drop (``mant-round:3|byteplane|zstd:3`` finds
the low byte mostly empty). The exponent range is untouched, so every value
keeps its relative precision: the error is at most half a unit in the last
kept place, ``2**(floor(log2|x|) - N - 1)`` (subnormals: the spacing at the
smallest normal exponent). A value whose rounding would carry past the
largest finite number is truncated instead (error below one unit). With N at
least the dtype's own mantissa width the values are kept as they are.
"""

from __future__ import annotations

import numpy as np

from kvtool.dtypes import dtype_of
from kvtool.layouts.base import PlaneSpec
from kvtool.layouts.lossy import LossyLayout, finite_values, int_param, ulp


class MantRound(LossyLayout):
    layout_id = "mant-round"
    params = ("bits",)
    spec_param = "bits"
    param_types = {"bits": int}  # noqa: RUF012 - a ClassVar, declared in LossyLayout

    def __init__(self, bits: int = 3):
        self.bits = int_param(self.layout_id, "bits", bits, 0, 23)

    def plan_plane(self, spec: PlaneSpec) -> list[PlaneSpec]:
        self.check_input(spec, ndim=None)
        return [spec]

    def forward_plane(self, plane: np.ndarray) -> list[np.ndarray]:
        dtype = dtype_of(plane.dtype)
        drop = dtype.mantissa_bits - self.bits
        finite_values(self.layout_id, plane)
        bits = np.ascontiguousarray(plane).view(dtype.bits_view)
        if drop <= 0:
            return [bits.copy().view(plane.dtype)]
        one = bits.dtype.type(1)
        keep = ~((one << drop) - one)  # mask of the sign, the exponent and the kept mantissa bits
        # Round to nearest even on the bit pattern: add just under half a unit, plus the kept LSB.
        rounded = bits + ((one << (drop - 1)) - one) + ((bits >> drop) & one)
        rounded &= keep
        exponent_mask = bits.dtype.type(((1 << dtype.exponent_bits) - 1) << dtype.mantissa_bits)
        overflowed = (rounded & exponent_mask) == exponent_mask
        rounded[overflowed] = bits[overflowed] & keep
        return [rounded.view(plane.dtype)]

    def inverse_plane(self, planes: list[np.ndarray], spec: PlaneSpec) -> np.ndarray:
        return planes[0]

    def error_bound(self, block: np.ndarray) -> np.ndarray:
        dtype = dtype_of(block.dtype)
        bits = min(self.bits, dtype.mantissa_bits)
        unit = ulp(block.astype(np.float64), dtype.exponent_bits, bits)
        if bits == dtype.mantissa_bits:
            return np.zeros(block.shape)
        largest = np.ldexp(2.0 - 2.0 ** -bits, (1 << (dtype.exponent_bits - 1)) - 1)  # the largest N-bit value
        return np.where(np.abs(block.astype(np.float64)) > largest, unit, 0.5 * unit)
