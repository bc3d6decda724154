"""``sx-split``: each float as an (exponent, sign change) symbol plus its mantissa bits.

The exponent of a KV value depends on its channel, and the sign of a
post-RoPE key channel tends to repeat from one token to the next. This layout
turns every float into a 16-bit symbol that an entropy coder (the ``rans``
codec) models per channel, and packs the nearly random mantissas densely so
they can be stored raw. For an input plane ``p`` of ``n`` values:

``p.sx``
    ``uint16``, ``p``'s shape: ``exponent << 1 | s``, where ``s`` is the
    sign bit XOR the sign bit of the previous element along the token axis
    (the first element keeps its sign). A channel's symbols then span twice
    its exponent range, however its signs fall.
``p.mant``
    ``uint8``, ``[w * ceil(n / 8)]`` for ``w`` mantissa bits: bit planes,
    most significant mantissa bit first, each the ``n`` values' bits in C
    order packed 8 to a byte, first value in the most significant bit
    (``np.packbits``), zero padded.

(Names are ``sx`` and ``mant`` for the chain's input plane.) It takes bf16,
fp16 and the two fp8 types; others raise ``UsageError``. The token axis is the
spec argument, counted from the end, as for ``xor-delta``: written without one
in a chain, ``parse_layouts`` points it at wherever the earlier stages moved
the tokens (``channel-major|sx-split`` means ``sx-split:-1``). Planes with
fewer axes than that take the sign change along their last axis.

"""

from __future__ import annotations

import numpy as np

from kvtool.dtypes import DTYPES
from kvtool.errors import UsageError
from kvtool.layouts.base import PlaneSpec, TokenAxisLayout, child_name, dtype_name

#: The dtypes whose sign and exponent fit one 16-bit symbol and whose mantissa fits another.
SPLIT_DTYPES = {DTYPES[name].numpy: DTYPES[name] for name in ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2")}


class SignExponentSplit(TokenAxisLayout):
    layout_id = "sx-split"

    def plan_plane(self, spec: PlaneSpec) -> list[PlaneSpec]:
        dtype = self._dtype(spec.dtype)
        n = int(np.prod(spec.shape, dtype=np.int64))
        return [
            PlaneSpec(child_name(spec.name, "sx"), tuple(spec.shape), np.dtype(np.uint16)),
            PlaneSpec(child_name(spec.name, "mant"), (dtype.mantissa_bits * -(-n // 8),), np.dtype(np.uint8)),
        ]

    def forward_plane(self, plane: np.ndarray) -> list[np.ndarray]:
        dtype = self._dtype(plane.dtype)
        bits = np.ascontiguousarray(plane.view(dtype.bits_view), dtype=np.uint16)
        sign = bits >> np.uint16(dtype.exponent_bits + dtype.mantissa_bits)
        if bits.ndim:
            change = sign.copy()
            axis = self._axis(bits.ndim)
            _along(change, axis)[1:] ^= _along(sign, axis)[:-1]
        else:
            change = sign
        sx = (bits >> np.uint16(dtype.mantissa_bits)) & np.uint16((1 << dtype.exponent_bits) - 1)
        sx <<= np.uint16(1)
        sx |= change
        field = bits.reshape(-1).astype(np.uint8 if dtype.mantissa_bits <= 8 else np.uint16)
        mant = [np.packbits(field & field.dtype.type(1 << b)) for b in reversed(range(dtype.mantissa_bits))]
        return [sx, np.concatenate(mant) if mant else np.zeros(0, np.uint8)]

    def inverse_plane(self, planes: list[np.ndarray], spec: PlaneSpec) -> np.ndarray:
        dtype = self._dtype(spec.dtype)
        sx, mant = np.ascontiguousarray(planes[0]), planes[1]
        sign = sx & np.uint16(1)
        if sx.ndim:
            np.bitwise_xor.accumulate(sign, axis=self._axis(sx.ndim), out=sign)
        bits = sign << np.uint16(dtype.exponent_bits)
        bits |= sx >> np.uint16(1)
        bits <<= np.uint16(dtype.mantissa_bits)
        flat = bits.reshape(-1)
        for plane, b in zip(mant.reshape(dtype.mantissa_bits, -1), reversed(range(dtype.mantissa_bits))):
            flat |= np.unpackbits(plane, count=flat.size).astype(np.uint16) << np.uint16(b)
        return bits.astype(dtype.bits_view).view(dtype.numpy)

    def _axis(self, ndim: int) -> int:
        return self.axis % ndim if ndim >= -self.axis else ndim - 1

    def _dtype(self, dtype: np.dtype):
        found = SPLIT_DTYPES.get(np.dtype(dtype))
        if found is None:
            raise UsageError(
                f"layout {self.layout_id!r} splits {', '.join(d.name for d in SPLIT_DTYPES.values())} values, "
                f"not {dtype_name(dtype)}"
            )
        return found


def _along(array: np.ndarray, axis: int) -> np.ndarray:
    """A view of ``array`` with ``axis`` first, so ``[1:]`` slices along it."""
    return np.moveaxis(array, axis, 0)
