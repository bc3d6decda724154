"""Torch tensors and numpy arrays of the same bits: KV caches cross between them without conversion.

numpy has no bfloat16 or fp8; ``ml_dtypes`` gives it those types, and a tensor's
bits reach numpy through a same-width integer view, sharing memory. Only the
modules that run a model or an engine import this (it imports torch).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from kvtool.errors import UsageError

_NUMPY_OF = {
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
}
_SAME_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy (``ml_dtypes``) dtype with ``dtype``'s bit layout."""
    try:
        return _NUMPY_OF[dtype]
    except KeyError:
        raise UsageError(f"KV cache dtype {dtype} is not supported; supported: {sorted(map(str, _NUMPY_OF))}") from None


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's data as a numpy array of the matching dtype, sharing memory."""
    dtype = numpy_dtype(tensor.dtype)
    return tensor.view(_SAME_BITS[dtype.itemsize]).numpy().view(dtype)


def from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor of ``dtype`` sharing ``array``'s bytes (which must be that dtype's bit pattern).

    A read-only array (a decoded chunk may be one) is copied: torch wants writable memory.
    """
    if numpy_dtype(dtype) != array.dtype:
        raise UsageError(f"the KV array is {array.dtype}, the tensor needs {dtype}")
    bits = np.ascontiguousarray(array).view(f"<i{array.dtype.itemsize}" if array.dtype.itemsize > 1 else "u1")
    if not bits.flags.writeable:
        bits = bits.copy()
    return torch.from_numpy(bits).view(dtype)
