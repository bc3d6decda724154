"""``bf16-split`` and ``fp16-split``: sign, exponent and mantissa fields in separate planes.

A float's exponent field is low-entropy (a channel's values share a scale), its
mantissa nearly random, and a key channel's sign often predictable. Apart, a
coder can squeeze the exponents and signs and leave the mantissas raw. For an
input plane ``p`` of ``n`` values, in C order (the order earlier stages left):

``p.exp``
    ``uint8``, ``p``'s shape: the biased exponent field (8 bits for bf16, 5 for fp16).
``p.sign``
    ``uint8``, ``[ceil(n / 8)]``: the sign bits packed 8 to a byte, the first
    value in the most significant bit (``np.packbits``), zero padded.
``p.mant``
    bf16: ``uint8``, ``[7 * (n // 8) + n % 8]``: the 7-bit mantissas packed
    densely, so the plane can be stored raw. With ``q = n // 8`` and ``m`` the
    mantissas, byte ``j * q + i`` (``j < 7``, ``i < q``) is
    ``m[j*q + i] | (bit j of m[7*q + i]) << 7``; the last ``n % 8`` mantissas
    follow one per byte.
    fp16: ``uint16``, ``p``'s shape: the 10-bit mantissa field.

(Names are ``exp``, ``sign``, ``mant`` for the chain's input plane.) Other
dtypes raise ``UsageError``; cast first or use ``byteplane``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from kvtool.dtypes import DTYPES, DType
from kvtool.errors import UsageError
from kvtool.layouts.base import PlaneSpec, PlaneWiseLayout, child_name, dtype_name

#: ``7 - j``, ``1 << (7 - j)`` and ``1 << j`` for row ``j`` of the dense 7-bit packing.
_TOP_SHIFTS = np.arange(7, 0, -1, dtype=np.uint8)[:, None]
_TOP_FACTORS = np.uint8(1) << _TOP_SHIFTS
_TOP_MASKS = (np.uint8(1) << np.arange(7, dtype=np.uint8))[:, None]


class _FloatSplit(PlaneWiseLayout):
    dtype: ClassVar[DType]

    def plan_plane(self, spec: PlaneSpec) -> list[PlaneSpec]:
        if np.dtype(spec.dtype) != self.dtype.numpy:
            raise UsageError(
                f"layout {self.layout_id!r} splits {self.dtype.name} values; plane {spec.name!r} is "
                f"{dtype_name(spec.dtype)} (use byteplane for other dtypes)"
            )
        n = math.prod(spec.shape)
        return [
            PlaneSpec(child_name(spec.name, "exp"), tuple(spec.shape), np.dtype(np.uint8)),
            PlaneSpec(child_name(spec.name, "sign"), ((n + 7) // 8,), np.dtype(np.uint8)),
            self._mantissa_spec(child_name(spec.name, "mant"), tuple(spec.shape), n),
        ]

    def forward_plane(self, plane: np.ndarray) -> list[np.ndarray]:
        bits = np.ascontiguousarray(plane.view(np.uint16))
        exp = np.empty(bits.shape, np.uint8)
        np.right_shift(bits, self.dtype.mantissa_bits, out=exp, casting="unsafe")
        exp &= (1 << self.dtype.exponent_bits) - 1
        sign = np.packbits(bits.reshape(-1).view(np.int16) < 0)
        return [exp, sign, self._mantissa_plane(bits)]

    def inverse_plane(self, planes: list[np.ndarray], spec: PlaneSpec) -> np.ndarray:
        exp, sign, mant = planes
        bits = exp.astype(np.uint16)
        bits <<= self.dtype.mantissa_bits
        bits |= self._mantissa_field(mant, spec.shape)
        signs = np.unpackbits(sign, count=bits.size).reshape(bits.shape).astype(np.uint16)
        signs <<= 15
        bits |= signs
        return bits.view(self.dtype.numpy)

    # How the mantissas are stored: by default the field as is, in the input's shape.
    def _mantissa_spec(self, name: str, shape: tuple[int, ...], n: int) -> PlaneSpec:
        return PlaneSpec(name, shape, np.dtype(np.uint16))

    def _mantissa_plane(self, bits: np.ndarray) -> np.ndarray:
        """The ``mant`` plane of contiguous bit patterns."""
        return bits & np.uint16((1 << self.dtype.mantissa_bits) - 1)

    def _mantissa_field(self, mant: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The mantissa field of each value, shaped ``shape``, from the ``mant`` plane."""
        return mant


class Bf16Split(_FloatSplit):
    layout_id = "bf16-split"
    dtype = DTYPES["bf16"]

    def _mantissa_spec(self, name: str, shape: tuple[int, ...], n: int) -> PlaneSpec:
        return PlaneSpec(name, (7 * (n // 8) + n % 8,), np.dtype(np.uint8))

    def _mantissa_plane(self, bits: np.ndarray) -> np.ndarray:
        low = bits.reshape(-1).astype(np.uint8)  # exponent's low bit, then the mantissa
        q = low.size // 8
        rows = low[: 8 * q].reshape(8, q)
        packed = np.empty(7 * q + low.size % 8, np.uint8)
        body = packed[: 7 * q].reshape(7, q)
        # Bit j of the last row's value to bit 7 of row j; numpy multiplies bytes far faster than it shifts them by an array.
        np.multiply(rows[7], _TOP_FACTORS, out=body)
        body &= 0x80
        rows[:7] &= 0x7F
        body |= rows[:7]
        np.bitwise_and(low[8 * q :], 0x7F, out=packed[7 * q :])
        return packed

    def _mantissa_field(self, mant: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        n = math.prod(shape)
        q = n // 8
        out = np.empty(n, np.uint8)
        rows = out[: 8 * q].reshape(8, q)
        body = mant[: 7 * q].reshape(7, q)
        np.bitwise_and(body, 0x7F, out=rows[:7])
        tops = body >> _TOP_SHIFTS
        tops &= _TOP_MASKS
        np.bitwise_or.reduce(tops, axis=0, out=rows[7])
        out[8 * q :] = mant[7 * q :]
        return out.reshape(shape)


class Fp16Split(_FloatSplit):
    layout_id = "fp16-split"
    dtype = DTYPES["fp16"]
