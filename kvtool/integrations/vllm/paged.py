"""vLLM's paged KV tensors seen as per-block keys and values, and copies between them and numpy.

vLLM hands the connector one tensor per attention layer. Its logical shape is
``[num_blocks, kv_heads, block_size, 2 * head_dim]`` in vLLM 0.32 for both
backends below, but the last two axes mean different things:

- ``CPU_ATTN`` (vLLM's CPU backend) views each block as ``[kv_heads,
  2 * block_size, head_dim]``: the block's key rows, then its value rows.
- CUDA backends (``FLASH_ATTN`` and others) split the last axis: keys are
  ``[..., :head_dim]``, values ``[..., head_dim:]`` (the physical strides may
  be permuted; views follow them).

Older vLLM releases gave CUDA backends a ``[2, num_blocks, block_size,
kv_heads, head_dim]`` tensor; that shape is recognised too. Any other shape
is refused with a clear error rather than guessed at.

Both K and V come out as ``[num_blocks, kv_heads, block_size, head_dim]``
views of the same storage, so writing into them writes vLLM's cache. Where the
CPU backend's kernel lays a block's tiles out otherwise than as token rows
(``kvtool.integrations.vllm.cpu_tiles``: keys column-major for its ``vec``
kernels, pairs packed for ``amx``), a view is a ``TiledBlocks`` that reorders
whole blocks on the way in and out (``gather_blocks``, ``put_blocks``). A block
id ``SKIPPED`` (a block vLLM does not keep, outside a sliding window) is left
out of every copy into the cache. An fp8 cache, which vLLM's CPU backend
allocates as bytes, is viewed as its fp8 type (``typed``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, TypeAlias

import numpy as np
import torch

from kvtool.destinations import Rows
from kvtool.errors import UsageError
from kvtool.integrations.vllm.cpu_tiles import TiledBlocks
from kvtool.integrations.vllm.kv_groups import SKIPPED
from kvtool.torchbits import PagedViews, as_bits, from_numpy, numpy_dtype, to_numpy

if TYPE_CHECKING:
    from kvtool.integrations.vllm.plan import BlockTable

__all__ = ["BlockView", "from_numpy", "gather_blocks", "grouped_blocks", "kv_views", "numpy_dtype", "put_blocks",
           "scatter_blocks", "to_numpy", "typed"]

#: One layer's keys or values in vLLM's pages: a ``[num_blocks, kv_heads, block_size, head_dim]`` view, or tiles in
#: another order (vLLM's CPU kernels).
BlockView: TypeAlias = "torch.Tensor | TiledBlocks"

#: kvtool's fp8 dtypes -> torch's, for caches vLLM allocates as bytes.
_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def typed(layer: torch.Tensor, dtype: str) -> torch.Tensor:
    """A layer's paged tensor as kvtool dtype ``dtype``: vLLM's CPU backend keeps an fp8 cache as ``uint8``."""
    if layer.dtype == torch.uint8 and dtype in _FP8:
        return layer.view(_FP8[dtype])
    return layer


def kv_views(layer: torch.Tensor, backend: str, head_dim: int, block_size: int,
             tile_orders: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> tuple[BlockView, BlockView]:
    """Key and value views ``[num_blocks, kv_heads, block_size, head_dim]`` of one layer's paged tensor; on vLLM's CPU
    backend, ``tile_orders`` (``cpu_tiles.tile_orders``) says where each token's values lie in a block's tiles."""
    shape = tuple(layer.shape)
    if layer.dim() == 4 and shape[2] == block_size and shape[3] == 2 * head_dim:
        if backend.upper().startswith("CPU"):
            blocks, heads = shape[0], shape[1]
            rows = layer.view(blocks, heads, 2 * block_size, head_dim)
            halves = rows[:, :, :block_size], rows[:, :, block_size:]
            keys, values = (half if order is None else TiledBlocks(half, order) for half, order in zip(halves, tile_orders))
            return keys, values
        return layer[..., :head_dim], layer[..., head_dim:]
    if layer.dim() == 5 and shape[0] == 2 and shape[2] == block_size and shape[4] == head_dim:
        return layer[0].transpose(1, 2), layer[1].transpose(1, 2)
    raise UsageError(
        f"unsupported paged KV layout {list(shape)} for attention backend {backend} "
        f"(block size {block_size}, head dim {head_dim}); see docs/VLLM.md"
    )


def gather_blocks(view: BlockView, block_ids: Sequence[int]) -> np.ndarray:
    """The blocks ``block_ids`` of a K or V view as one ``[kv_heads, tokens, head_dim]`` host array (a copy)."""
    if isinstance(view, TiledBlocks):
        picked = view.gather(block_ids)
    else:
        picked = view.index_select(0, torch.as_tensor(list(block_ids), dtype=torch.long, device=view.device))
    # picked: [n, heads, block, dim]
    n, heads, block, dim = picked.shape
    tokens = picked.permute(1, 0, 2, 3).reshape(heads, n * block, dim).to("cpu").contiguous()
    return to_numpy(tokens)


def put_blocks(view: BlockView, index: torch.Tensor, blocks: torch.Tensor) -> None:
    """Write ``[n, kv_heads, block_size, head_dim]`` ``blocks`` into the blocks ``index`` of a K or V view."""
    if isinstance(view, TiledBlocks):
        view.put(index, blocks)
    else:
        as_bits(view).index_copy_(0, index, as_bits(blocks.to(view.device, non_blocking=True)))


def scatter_blocks(view: BlockView, block_ids: Sequence[int], array: torch.Tensor) -> None:
    """Write ``array`` (``[kv_heads, len(block_ids) * block_size, head_dim]``) into blocks ``block_ids``
    (those that are not ``SKIPPED``)."""
    n = len(block_ids)
    _, heads, block, dim = view.shape
    if tuple(array.shape) != (heads, n * block, dim):
        raise UsageError(f"restored KV has shape {list(array.shape)}, blocks need {[heads, n * block, dim]}")
    blocks = array.view(heads, n, block, dim).permute(1, 0, 2, 3)
    kept = [i for i, b in enumerate(block_ids) if b != SKIPPED]
    if len(kept) < n:
        blocks = blocks[kept]
    put_blocks(view, torch.as_tensor([block_ids[i] for i in kept], dtype=torch.long, device=view.device), blocks)


def grouped_blocks(paged: PagedViews, groups: Sequence[int], block_ids: "BlockTable", block_size: int,
                   picked: Sequence[int]) -> Rows:
    """A restore destination where views ``picked`` (of ``paged``) belong to KV cache groups ``groups`` (one each):
    each view's tokens fill its group's list of ``block_ids`` in order, those of ``SKIPPED`` blocks left out."""
    table = np.empty((len(picked), paged.heads, len(block_ids[0]) * block_size), np.int64)
    for group in sorted(set(groups)):
        ids = list(block_ids[group])
        views = [i for i, g in enumerate(groups) if g == group]
        rows = paged.blocks([max(b, 0) for b in ids], 0, [picked[i] for i in views]).table
        rows[:, :, np.repeat(np.asarray(ids) == SKIPPED, block_size)] = -1
        table[views] = rows
    return Rows(paged.targets, table, [paged.target_of[v] for v in picked])
