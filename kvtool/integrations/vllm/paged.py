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
views of the same storage, so writing into them writes vLLM's cache.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvtool.errors import UsageError
from kvtool.torchbits import from_numpy, numpy_dtype, to_numpy

__all__ = ["from_numpy", "gather_blocks", "kv_views", "numpy_dtype", "scatter_blocks", "to_numpy"]

def kv_views(layer: torch.Tensor, backend: str, head_dim: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views ``[num_blocks, kv_heads, block_size, head_dim]`` of one layer's paged tensor."""
    shape = tuple(layer.shape)
    if layer.dim() == 4 and shape[2] == block_size and shape[3] == 2 * head_dim:
        if backend.upper().startswith("CPU"):
            blocks, heads = shape[0], shape[1]
            rows = layer.view(blocks, heads, 2 * block_size, head_dim)
            return rows[:, :, :block_size], rows[:, :, block_size:]
        return layer[..., :head_dim], layer[..., head_dim:]
    if layer.dim() == 5 and shape[0] == 2 and shape[2] == block_size and shape[4] == head_dim:
        return layer[0].transpose(1, 2), layer[1].transpose(1, 2)
    raise UsageError(
        f"unsupported paged KV layout {list(shape)} for attention backend {backend} "
        f"(block size {block_size}, head dim {head_dim}); see docs/VLLM.md"
    )


def gather_blocks(view: torch.Tensor, block_ids: Sequence[int]) -> np.ndarray:
    """The blocks ``block_ids`` of a K or V view as one ``[kv_heads, tokens, head_dim]`` host array (a copy)."""
    index = torch.as_tensor(list(block_ids), dtype=torch.long, device=view.device)
    picked = view.index_select(0, index)  # [n, heads, block, dim]
    n, heads, block, dim = picked.shape
    tokens = picked.permute(1, 0, 2, 3).reshape(heads, n * block, dim).to("cpu").contiguous()
    return to_numpy(tokens)


def scatter_blocks(view: torch.Tensor, block_ids: Sequence[int], array: torch.Tensor) -> None:
    """Write ``array`` (``[kv_heads, len(block_ids) * block_size, head_dim]``) into blocks ``block_ids``."""
    n = len(block_ids)
    _, heads, block, dim = view.shape
    if tuple(array.shape) != (heads, n * block, dim):
        raise UsageError(f"restored KV has shape {list(array.shape)}, blocks need {[heads, n * block, dim]}")
    blocks = array.view(heads, n, block, dim).permute(1, 0, 2, 3).to(view.device, non_blocking=True)
    index = torch.as_tensor(list(block_ids), dtype=torch.long, device=view.device)
    view.index_copy_(0, index, blocks)
