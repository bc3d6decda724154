"""The element types a KV cache may hold, and their bit patterns.

Low-precision floats are numpy arrays of ``ml_dtypes`` types, so their bit
patterns are handled without torch; ``ml_dtypes`` is imported when one is first needed. Layouts, codecs and statistics need only
this table, not the cache model.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import numpy as np

from kvtool.errors import UsageError


@dataclass(frozen=True)
class DType:
    """One element type. ``numpy`` is resolved when first asked for: the low-precision types come
    from ``ml_dtypes``, whose import costs most of a command's start-up (0.7 s of CPU), so a
    command that reads only headers, indexes or checksums never pays it."""

    name: str  # kvtool's name
    numpy_name: str  # numpy's name of the type: ``bfloat16``, ``float16``
    safetensors: str  # the dtype string in a safetensors header
    exponent_bits: int
    mantissa_bits: int
    module: str = "numpy"  # where the type lives: numpy, or ml_dtypes

    @functools.cached_property
    def numpy(self) -> np.dtype:
        scalar_type: type = getattr(importlib.import_module(self.module), self.numpy_name)
        return np.dtype(scalar_type)

    @property
    def itemsize(self) -> int:
        return (self.exponent_bits + self.mantissa_bits + 1) // 8

    @property
    def bits_view(self) -> np.dtype:
        """The unsigned integer dtype with the same bit pattern."""
        return np.dtype(f"u{self.itemsize}")


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("bf16", "bfloat16", "BF16", 8, 7, "ml_dtypes"),
        DType("fp16", "float16", "F16", 5, 10),
        DType("fp32", "float32", "F32", 8, 23),
        DType("fp8_e4m3", "float8_e4m3fn", "F8_E4M3", 4, 3, "ml_dtypes"),
        DType("fp8_e5m2", "float8_e5m2", "F8_E5M2", 5, 2, "ml_dtypes"),
    )
}


def register_numpy_types() -> None:
    """Make numpy know every type by its name (``np.dtype("bfloat16")``), as safetensors' numpy reader
    expects: it imports ``ml_dtypes``."""
    for d in DTYPES.values():
        d.numpy  # noqa: B018 - resolving the type registers it with numpy


def dtype_of(array_or_name: np.ndarray | np.dtype | str) -> DType:
    """kvtool's dtype record for a numpy array, numpy dtype, or name (``bf16``, ``BF16``, ``float16``)."""
    if isinstance(array_or_name, str):
        for d in DTYPES.values():
            if array_or_name in (d.name, d.safetensors, d.numpy_name):
                return d
        raise UsageError(f"unsupported dtype {array_or_name!r}; supported: {', '.join(DTYPES)}")
    dt = np.dtype(getattr(array_or_name, "dtype", array_or_name))
    for d in DTYPES.values():  # by name first: an array of an ml_dtypes type means ml_dtypes is loaded already
        if d.numpy_name == dt.name and d.numpy == dt:
            return d
    raise UsageError(f"unsupported dtype {dt}; supported: {', '.join(DTYPES)}")


def bits_of(array: np.ndarray) -> np.ndarray:
    """``array``'s bit patterns as unsigned integers of the same width (a view, no copy)."""
    return array.view(dtype_of(array).bits_view)
