"""``fp8:FORMAT``: values as fp8 (e4m3 or e5m2) with a power-of-two scale per channel (lossy).

The block ``[heads, tokens, dim]`` becomes one fp8 plane ``[heads, tokens +
groups, dim]``: the tokens in groups of ``group`` (``0``, the default: one
group for the whole block), each group preceded by one *scale row*. Byte ``c``
of a scale row holds, as a signed 8-bit integer ``e``, the exponent of the
scale of channel ``c`` in that group: the values stored below it are
``x * 2**-e`` rounded to the format (nearest, ties to even), and ``e`` is the
smallest exponent that keeps the channel's largest magnitude within the
format's largest finite value (448 for e4m3, 57344 for e5m2). Zero channels
get ``e = 0``. Decoding multiplies back: ``fp8 * 2**e``.

A power of two scales exactly, so each value keeps the format's relative
precision (3 or 2 mantissa bits: a relative error of at most 2**-4 or 2**-3)
down to the format's smallest normal number times the scale, and the error
stays below half the subnormal spacing under it. The plane is one fp8 block,
so the ``exphuff`` codec can follow (``fp8:e4m3|exphuff``), as can byte codecs.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kvtool.dtypes import DTYPES, dtype_of
from kvtool.layouts.base import PlaneSpec
from kvtool.layouts.lossy import LossyLayout, choice_param, finite_values, int_param, rounding_bound

FORMATS = {"e4m3": DTYPES["fp8_e4m3"], "e5m2": DTYPES["fp8_e5m2"]}
MAX_GROUP = 1 << 20
#: Scale exponents are stored as int8.
MIN_EXPONENT, MAX_EXPONENT = -128, 127


class Fp8(LossyLayout):
    layout_id = "fp8"
    params = ("format", "group")
    spec_param = "format"
    param_types = {"group": int}  # noqa: RUF012 - a ClassVar, declared in LossyLayout

    def __init__(self, format: str = "e4m3", group: int = 0):
        self.format = choice_param(self.layout_id, "format", format, tuple(FORMATS))
        self.group = int_param(self.layout_id, "group", group, 0, MAX_GROUP)
        self._fp8 = FORMATS[self.format]
        self._max = float(ml_dtypes.finfo(self._fp8.numpy).max)

    def _group_size(self, tokens: int) -> int:
        return self.group or max(tokens, 1)

    def plan_plane(self, spec: PlaneSpec) -> list[PlaneSpec]:
        self.check_input(spec)
        heads, tokens, dim = spec.shape
        groups = -(-tokens // self._group_size(tokens))
        return [PlaneSpec(spec.name, (heads, tokens + groups, dim), self._fp8.numpy)]

    def forward_plane(self, plane: np.ndarray) -> list[np.ndarray]:
        grouped, tokens = self._grouped(finite_values(self.layout_id, plane))  # [heads, groups, size, dim]
        exponents = self._exponents(np.abs(grouped).max(axis=2))  # [heads, groups, dim]
        rows = np.empty(grouped.shape[:2] + (grouped.shape[2] + 1, grouped.shape[3]), np.uint8)
        rows[:, :, 0] = exponents.astype(np.int8).view(np.uint8)
        scaled = np.ldexp(grouped, -exponents[:, :, None, :])
        rows[:, :, 1:] = scaled.astype(np.float32).astype(self._fp8.numpy).view(np.uint8)
        return [self._cut(rows, tokens).view(self._fp8.numpy)]

    def inverse_plane(self, planes: list[np.ndarray], spec: PlaneSpec) -> np.ndarray:
        heads, tokens, dim = spec.shape
        size = self._group_size(tokens)
        groups = -(-tokens // size)
        rows: np.ndarray = np.zeros((heads, groups * (size + 1), dim), np.uint8)
        rows[:, : tokens + groups] = planes[0].view(np.uint8)
        rows = rows.reshape(heads, groups, size + 1, dim)
        exponents = rows[:, :, 0].view(np.int8).astype(np.int32)
        values = rows[:, :, 1:].view(self._fp8.numpy).astype(np.float32)
        with np.errstate(over="ignore"):  # only a damaged scale row overflows; checksums catch those first
            values = np.ldexp(values, exponents[:, :, None, :])
        return values.reshape(heads, groups * size, dim)[:, :tokens].astype(spec.dtype)

    def error_bound(self, block: np.ndarray) -> np.ndarray:
        grouped, tokens = self._grouped(block.astype(np.float64))
        exponents = self._exponents(np.abs(grouped).max(axis=2))[:, :, None, :]
        scaled = np.ldexp(np.abs(grouped), -exponents)
        quantum = np.ldexp(rounding_bound(scaled, self._fp8), exponents)
        heads, groups, size, dim = grouped.shape
        quantum = quantum.reshape(heads, groups * size, dim)[:, :tokens]
        out = dtype_of(block.dtype)
        return quantum + rounding_bound(np.abs(block.astype(np.float64)) + quantum, out)

    def _grouped(self, values: np.ndarray) -> tuple[np.ndarray, int]:
        """``[heads, tokens, dim]`` as ``[heads, groups, size, dim]``, the last group padded with zeros."""
        heads, tokens, dim = values.shape
        size = self._group_size(tokens)
        groups = -(-tokens // size)
        padded = np.zeros((heads, groups * size, dim), values.dtype)
        padded[:, :tokens] = values
        return padded.reshape(heads, groups, size, dim), tokens

    def _exponents(self, largest: np.ndarray) -> np.ndarray:
        """Per channel and group, the smallest ``e`` with ``largest * 2**-e <= max``, as int32 (0 for zero channels)."""
        with np.errstate(divide="ignore"):
            guess = np.ceil(np.log2(largest / self._max))
        guess = np.where(largest > 0, guess, 0).astype(np.int32)
        guess += np.ldexp(largest, -guess) > self._max  # log2 may miss by one either way
        guess -= np.ldexp(largest, 1 - guess) <= self._max
        guess[largest == 0] = 0
        return np.clip(guess, MIN_EXPONENT, MAX_EXPONENT)

    def _cut(self, rows: np.ndarray, tokens: int) -> np.ndarray:
        """Rows ``[heads, groups, size + 1, dim]`` as the plane ``[heads, tokens + groups, dim]`` (padding dropped)."""
        heads, groups, size_plus, dim = rows.shape
        return np.ascontiguousarray(rows.reshape(heads, groups * size_plus, dim)[:, : tokens + groups])
