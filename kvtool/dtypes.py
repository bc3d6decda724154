"""The element types a KV cache may hold, and their bit patterns.

Low-precision floats are numpy arrays of ``ml_dtypes`` types, so their bit
patterns are handled without torch. Layouts, codecs and statistics need only
this table, not the cache model.
"""

from __future__ import annotations

from dataclasses import dataclass
import ml_dtypes
import numpy as np

from kvtool.errors import UsageError


@dataclass(frozen=True)
class DType:
    name: str  # kvtool's name
    numpy: np.dtype
    safetensors: str  # the dtype string in a safetensors header
    exponent_bits: int
    mantissa_bits: int

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def bits_view(self) -> np.dtype:
        """The unsigned integer dtype with the same bit pattern."""
        return np.dtype(f"u{self.itemsize}")


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("bf16", np.dtype(ml_dtypes.bfloat16), "BF16", 8, 7),
        DType("fp16", np.dtype(np.float16), "F16", 5, 10),
        DType("fp32", np.dtype(np.float32), "F32", 8, 23),
        DType("fp8_e4m3", np.dtype(ml_dtypes.float8_e4m3fn), "F8_E4M3", 4, 3),
        DType("fp8_e5m2", np.dtype(ml_dtypes.float8_e5m2), "F8_E5M2", 5, 2),
    )
}


def dtype_of(array_or_name: np.ndarray | np.dtype | str) -> DType:
    """kvtool's dtype record for a numpy array, numpy dtype, or name (``bf16``, ``BF16``, ``float16``)."""
    if isinstance(array_or_name, str):
        for d in DTYPES.values():
            if array_or_name in (d.name, d.safetensors, d.numpy.name):
                return d
        raise UsageError(f"unsupported dtype {array_or_name!r}; supported: {', '.join(DTYPES)}")
    dt = np.dtype(getattr(array_or_name, "dtype", array_or_name))
    for d in DTYPES.values():
        if d.numpy == dt:
            return d
    raise UsageError(f"unsupported dtype {dt}; supported: {', '.join(DTYPES)}")


def bits_of(array: np.ndarray) -> np.ndarray:
    """``array``'s bit patterns as unsigned integers of the same width (a view, no copy)."""
    return array.view(dtype_of(array).bits_view)
