"""Torch tensors and numpy arrays of the same bits: KV caches cross between them without conversion.

numpy has no bfloat16 or fp8; ``ml_dtypes`` gives it those types, and a tensor's
bits reach numpy through a same-width integer view, sharing memory. Only the
modules that run a model or an engine import this (it imports torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import ml_dtypes
import numpy as np
import torch

from kvtool.destinations import PagedBlocks
from kvtool.errors import UsageError

_NUMPY_OF: dict[torch.dtype, np.dtype] = {
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
}
_SAME_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as integers of its element size: moved bit for bit by kernels every dtype has (torch's
    ``index_copy_`` has none for fp8)."""
    return tensor.view(_SAME_BITS[tensor.element_size()])


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy (``ml_dtypes``) dtype with ``dtype``'s bit layout."""
    try:
        return _NUMPY_OF[dtype]
    except KeyError:
        raise UsageError(f"KV cache dtype {dtype} is not supported; supported: {sorted(map(str, _NUMPY_OF))}") from None


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's data as a numpy array of the matching dtype, sharing memory."""
    dtype = numpy_dtype(tensor.dtype)
    array: np.ndarray = tensor.view(_SAME_BITS[dtype.itemsize]).numpy().view(dtype)
    return array


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


def storage_bytes(view: torch.Tensor) -> np.ndarray:
    """The whole storage under a CPU tensor view, as a writable flat byte array sharing its memory."""
    whole = torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage())
    flat: np.ndarray = whole.numpy()
    return flat


@dataclass(frozen=True)
class PagedViews:
    """Where CPU ``[num_blocks, heads, block_size, dim]`` views (an engine's paged K and V) lie in their storages, read
    once: ``blocks`` then makes the restore destination of any block table cheaply. Views over one storage share
    one target."""

    targets: list[np.ndarray]
    target_of: list[int]
    storage_offset: list[int]
    strides: list[tuple[int, int, int]]
    heads: int
    block_size: int
    itemsize: int

    @classmethod
    def of(cls, views: Sequence[torch.Tensor]) -> "PagedViews":
        first = views[0]
        if any(v.stride(3) != 1 or v.shape[1:] != first.shape[1:] for v in views):
            raise UsageError(f"paged KV views must share one shape with contiguous rows (strides {list(first.stride())})")
        targets: list[np.ndarray] = []
        target_of: list[int] = []
        storages: dict[int, int] = {}
        for view in views:
            pointer = view.untyped_storage().data_ptr()
            if pointer not in storages:
                storages[pointer] = len(targets)
                targets.append(storage_bytes(view))
            target_of.append(storages[pointer])
        return cls(targets, target_of, [v.storage_offset() for v in views],
                   [(v.stride(0), v.stride(1), v.stride(2)) for v in views], int(first.shape[1]), int(first.shape[2]),
                   first.element_size())

    def blocks(self, block_ids: Sequence[int], skip: int = 0, picked: Sequence[int] | None = None) -> PagedBlocks:
        """The views ``picked`` (all by default; tensor ``p`` of a read goes to ``picked[p]``) as a destination whose
        tokens fill blocks ``block_ids`` in order, the first ``skip`` left out."""
        chosen = range(len(self.target_of)) if picked is None else picked
        return PagedBlocks(self.targets, [self.target_of[i] for i in chosen], [self.storage_offset[i] for i in chosen],
                           [self.strides[i] for i in chosen], self.heads, self.block_size, self.itemsize, block_ids, skip)


def paged_blocks(views: Sequence[torch.Tensor], block_ids: Sequence[int], skip: int = 0) -> PagedBlocks:
    """CPU paged views as a restore destination (``PagedViews``), for a single use."""
    return PagedViews.of(views).blocks(block_ids, skip)
