"""``xor-delta``: each element's bit pattern XOR the previous one along an axis.

Along the token axis, neighbouring tokens of one channel often share sign and
exponent, so the XOR has zero high bits. The first element along the axis is
kept as is; the inverse is a running XOR. Planes keep their shape and dtype;
planes without that axis (the packed 1-D planes of ``bf16-split``) pass through.

The axis is the spec argument, counted from the end: ``xor-delta:-2`` (the
token axis of ``[heads, tokens, dim]``) or ``xor-delta:-1``. Written without one
in a chain, ``parse_layouts`` points it at wherever the earlier stages moved the
token axis (``channel-major|xor-delta`` means ``channel-major|xor-delta:-1``);
the config always records the axis, so decoding never infers it.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from kvtool.layouts.base import PlaneSpec, TokenAxisLayout, bits_dtype

LITTLE_ENDIAN = sys.byteorder == "little"


class XorDelta(TokenAxisLayout):
    layout_id = "xor-delta"

    def plan_plane(self, spec: PlaneSpec) -> list[PlaneSpec]:
        bits_dtype(self.layout_id, spec.dtype)
        return [spec]

    def forward_plane(self, plane: np.ndarray) -> list[np.ndarray]:
        if plane.ndim < -self.axis:
            return [plane]
        bits = np.ascontiguousarray(plane.view(bits_dtype(self.layout_id, plane.dtype)))
        out = np.empty(bits.shape, bits.dtype)
        src, dst = _runs(bits, self.axis), _runs(out, self.axis)
        dst[:, :1] = src[:, :1]
        np.bitwise_xor(src[:, 1:], src[:, :-1], out=dst[:, 1:])
        return [out.view(plane.dtype)]

    def inverse_plane(self, planes: list[np.ndarray], spec: PlaneSpec) -> np.ndarray:
        if len(spec.shape) < -self.axis:
            return planes[0]
        bits_type = bits_dtype(self.layout_id, spec.dtype)
        bits = np.ascontiguousarray(planes[0].view(bits_type))
        runs = _runs(bits, self.axis)
        if _fits_words(runs):
            return _running_xor_in_words(runs).reshape(spec.shape).view(spec.dtype)
        out = np.empty(bits.shape, bits_type)
        np.bitwise_xor.accumulate(runs, axis=1, out=_runs(out, self.axis))
        return out.view(spec.dtype)


def _fits_words(runs: np.ndarray) -> bool:
    """Whether ``_running_xor_in_words`` applies: small values, one per run step, whole words per run."""
    small = runs.itemsize < 4 and runs.shape[2] == 1 and runs.size > 0
    return small and runs.shape[1] % (8 // runs.itemsize) == 0 and LITTLE_ENDIAN


def _running_xor_in_words(runs: np.ndarray) -> np.ndarray:
    """The running XOR along axis 1 of ``[outer, n, 1]`` 8- or 16-bit values, 8 bytes at a time.

    numpy's accumulate is slow for small integers and strictly serial, so the
    values are viewed as 64-bit words of ``lanes`` consecutive values: a prefix
    XOR inside each word takes two or three shift-XORs, then each word XORs in
    the running value carried from the words before it (one accumulate over a
    quarter or an eighth as many elements). The lane order assumes a
    little-endian machine.
    """
    lane_bits = 8 * runs.itemsize
    deltas = runs.reshape(runs.shape[0], -1).view(np.uint64)
    words, shifted = np.empty_like(deltas), np.empty_like(deltas)
    np.left_shift(deltas, np.uint64(lane_bits), out=shifted)
    np.bitwise_xor(deltas, shifted, out=words)
    shift = 2 * lane_bits
    while shift < 64:
        np.left_shift(words, np.uint64(shift), out=shifted)
        words ^= shifted
        shift *= 2
    carry = words[:, :-1] >> np.uint64(64 - lane_bits)  # each word's last running value
    np.bitwise_xor.accumulate(carry, axis=1, out=carry)
    carry *= np.uint64(sum(1 << i for i in range(0, 64, lane_bits)))  # copy into every lane
    words[:, 1:] ^= carry
    return words.view(runs.dtype)


def _runs(bits: np.ndarray, axis: int) -> np.ndarray:
    """A contiguous array as ``[outer, along axis, inner]``, the inner part in the widest unsigned words.

    XOR acts on each bit alone, so the elements after the axis can be XORed as
    8-byte words instead of one by one: the same result, a fraction of the work.
    """
    axis %= bits.ndim
    outer, inner = (math.prod(part) for part in (bits.shape[:axis], bits.shape[axis + 1 :]))
    runs = bits.reshape(outer, bits.shape[axis], inner)
    inner_bytes = inner * bits.itemsize
    if runs.size == 0:
        return runs
    width = next(w for w in (8, 4, 2, 1) if inner_bytes % w == 0)
    return runs.view(np.dtype(f"u{width}"))
