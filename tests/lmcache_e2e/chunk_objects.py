"""Real KV chunks as LMCache's memory objects, for the adapter's tests and benchmarks/lmcache_l2 (needs LMCache)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

import kvtool

ROOT = Path(__file__).resolve().parents[2]


def kv_chunk(sample: str, tokens: int = 256) -> torch.Tensor:
    """A sample cache as LMCache's ``KV_2LTD`` chunk: ``[2, layers, tokens, heads * head_dim]`` bf16."""
    cache = kvtool.load(ROOT / "samples" / sample, tokens=slice(0, tokens))
    k = np.stack([a.transpose(1, 0, 2).reshape(tokens, -1) for a in cache.keys])
    v = np.stack([a.transpose(1, 0, 2).reshape(tokens, -1) for a in cache.values])
    return torch.from_numpy(np.stack([k, v]).view(np.uint16).astype(np.int16)).view(torch.bfloat16).clone()


def memory_obj(tensor: torch.Tensor) -> TensorMemoryObj:
    flat = tensor.contiguous().view(-1).view(torch.uint8)
    meta = MemoryObjMetadata(shape=tensor.shape, dtype=tensor.dtype, address=0, phy_size=flat.numel(),
                             fmt=MemoryFormat.KV_2LTD, ref_count=1)
    return TensorMemoryObj(raw_data=flat, metadata=meta, parent_allocator=None)


def empty_like(obj: TensorMemoryObj) -> TensorMemoryObj:
    return memory_obj(torch.full(obj.get_shape(), 7.0, dtype=obj.get_dtype()))
