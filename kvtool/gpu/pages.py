"""Paged KV blocks on the GPU as a restore destination: entries whose chunks the GPU decodes arrive stored.

``GpuPages`` is one step's restores into an engine's K/V views (``[num_blocks,
heads, block_size, dim]``, on CUDA, or CPU tensors under Triton's interpreter).
``entry(block_ids, first_block)`` is the destination of one entry: a chunk
pipeline hands it the entry's stored chunks (``takes_stored``: a recipe whose
codec ``gpu_decodes``), their checksums verified once on the host, and it
queues them with ``LayerwiseDecode``. ``start()`` queues every layer's copy
and decode; the forward pass waits per layer (``wait_layer``); ``failures()``
names the entries whose chunks the device refused. Imported only where the GPU
path runs (it imports torch and Triton).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from kvtool import gpu
from kvtool.destinations import Destination, StoredChunks, paged_rows
from kvtool.errors import UsageError
from kvtool.gpu.restore import EntryChunks, LayerwiseDecode


class GpuPages:
    """One step's GPU restores into ``keys[l]`` / ``values[l]``; make it on the forward pass's thread."""

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
        name = gpu.dtype_name(keys[0].dtype)
        if not self.usable(keys, values) or name is None:
            raise UsageError("these paged KV views cannot take GPU restores (see GpuPages.usable)")
        self.keys, self.values, self.dtype = list(keys), list(values), name
        self._decode = LayerwiseDecode(self.keys, self.values, name)

    @staticmethod
    def usable(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> bool:
        """Whether restores into these views can decode on the GPU: CUDA (or the interpreter on CPU tensors), a dtype
        the decoder writes, every layer laid out like the first (one row table serves all), contiguous rows."""
        ok, _ = gpu.status()
        first = keys[0]
        on_device = first.is_cuda or (gpu.interpreted() and first.device.type == "cpu")
        same = all(v.shape == first.shape and v.stride() == first.stride() for v in (*keys, *values))
        return ok and on_device and same and gpu.dtype_name(first.dtype) is not None and first.stride(3) == 1

    def entry(self, block_ids: Sequence[int], first_block: int = 0) -> "GpuEntryPages":
        """The destination of one entry whose tokens fill ``block_ids`` after its first ``first_block`` blocks."""
        return GpuEntryPages(self, block_ids, first_block)

    def add(self, chunks: EntryChunks) -> int:
        return self._decode.add(chunks)

    def start(self) -> None:
        """Queue every layer's copy and decode of the entries handed over so far."""
        self._decode.start()

    def wait_layer(self, layer: int) -> None:
        """Make the forward pass's stream wait for layer ``layer``; the host does not wait."""
        self._decode.wait_layer(layer)

    def failures(self) -> dict[int, int]:
        """Entries (by ``GpuEntryPages.index``) whose chunks the device refused, with the first status word."""
        return self._decode.failures()


class GpuEntryPages(Destination):
    """One entry's place in a step's ``GpuPages``: it takes the entry's stored chunks, never decoded blocks."""

    def __init__(self, pages: GpuPages, block_ids: Sequence[int], first_block: int):
        self.pages = pages
        self.ids = [0] * first_block + list(block_ids)  # the skipped blocks' rows are left out
        self.skip = first_block * pages.keys[0].shape[2]
        self.index = -1  # in the step's decode, once handed over

    def takes_stored(self, recipe: Any) -> bool:
        return bool(recipe.gpu_decodes)

    def fit(self, n: int, heads: int, tokens: int, row_bytes: int) -> None:
        keys = self.pages.keys
        _, view_heads, block_size, dim = keys[0].shape
        expected = (2 * len(keys), view_heads, len(self.ids) * block_size, dim * keys[0].element_size())
        if (n, heads, tokens, row_bytes) != expected:
            raise UsageError(f"the GPU pages take [{expected[0]}, {view_heads}, {expected[2]}] rows, not [{n}, {heads}, {tokens}]")

    def put_stored(self, chunks: StoredChunks) -> None:
        if chunks.dtype != self.pages.dtype:
            raise UsageError(f"the entry holds {chunks.dtype} tensors, the GPU pages {self.pages.dtype}")
        rows = np.stack([
            paged_rows(0, (view.stride(0), view.stride(1), view.stride(2)), view.shape[1], view.shape[2], self.ids,
                       self.skip)
            for view in (self.pages.keys[0], self.pages.values[0])
        ])
        self.index = self.pages.add(EntryChunks(
            chunks.data, chunks.position // 2, chunks.position % 2, chunks.offset, chunks.length, chunks.tokens,
            chunks.token, chunks.stored_raw.astype(np.int64), rows,
        ))
