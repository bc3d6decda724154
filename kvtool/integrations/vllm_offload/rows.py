"""What one row of vLLM's CPU offload region holds, and the store key of each chunk (``chunk_namer``).

vLLM's ``TieringOffloadingSpec`` keeps every offloaded chunk (``blocks_per_chunk``
consecutive blocks of one KV cache group) in one row of a shared memory region::

    row = | worker 0 | worker 1 | ... | worker W-1 | padding to a memory page |
    worker cell = | layer 0: block 0 page, block 1 page, ... | layer 1: ... | ...

(one worker cell when vLLM keeps a single copy for all workers, ``replicated_layout``).
A page is one block of one layer in the physical order vLLM's KV cache layout names,
logically ``[kv_heads, block_size, 2 * head_dim]``, keys in ``[..., :head_dim]`` and
values in ``[..., head_dim:]``:

- ``LBNHC`` (``NHD``): a page is ``[block_size, kv_heads, 2 * head_dim]``, so every
  token is one contiguous run of the layer's keys and values;
- ``LBHNC`` (``HND``): a page is ``[kv_heads, block_size, 2 * head_dim]``.

``RowLayout`` reads this from the spec's configuration, checks it against the row
size vLLM gives the tier, and refuses at startup anything else (several KV cache
groups, layers packed per block, the canonical layout, pipeline or context
parallelism, a KV dtype kvtool does not hold). It cuts a row into the
``[kv_heads, tokens, head_dim]`` arrays a recipe encodes: with ``head_dim`` known
(the tier's ``head_dim`` option), the true keys and values of each layer; without
it (``LBNHC`` only), each token's run split in two halves, one stored as "keys",
one as "values": every column still one channel, every byte kept, only a lossy
stage's idea of which half is which differs.

Pure numpy: no vLLM or torch import, so it is tested on its own.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtool.dtypes import DTYPES, DType
from kvtool.entries.names import ChunkNamer
from kvtool.errors import UsageError
from kvtool.integrations.vllm.kv_groups import KV_DTYPES as _DTYPES  # vLLM's names of the cache dtype -> kvtool's
_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
SUPPORTED_ORDERS = ("LBNHC", "LBHNC")


def _refuse(message: str) -> UsageError:
    return UsageError(f"kvtool tier: {message}")


@dataclass(frozen=True)
class RowLayout:
    """The arrays one offload row holds: ``copies`` worker cells of ``layers`` layers of ``blocks`` pages."""

    dtype: DType
    order: str  # LBNHC or LBHNC
    copies: int
    layers: int
    blocks: int
    block_tokens: int
    page_bytes: int  # one block of one layer
    head_dim: int | None
    row_stride: int  # bytes from one row to the next (the row and its padding)

    @classmethod
    def from_config(cls, config: Any, row_stride: int, replicated: bool, head_dim: int | None = None) -> "RowLayout":
        """Decode vLLM's ``OffloadingConfig`` (``offloading_spec.config``); raise one clear ``UsageError`` otherwise."""
        if getattr(config, "canonical_layout", False):
            raise _refuse("vLLM's canonical_layout is not supported; remove it from kv_connector_extra_config")
        if len(config.groups) != 1:
            raise _refuse(f"{len(config.groups)} KV cache groups (hybrid attention) are not supported, only one")
        par = config.parallel
        if par.pp_size != 1 or par.pcp_size != 1 or par.dcp_size != 1:
            raise _refuse(
                f"pipeline or context parallelism (pp={par.pp_size}, pcp={par.pcp_size}, dcp={par.dcp_size}) "
                "is not supported; tensor parallelism is"
            )
        dtype_name = _DTYPES.get(str(config.model.dtype))
        if dtype_name is None:
            raise _refuse(f"KV cache dtype {config.model.dtype!r} is not supported; supported: {', '.join(_DTYPES)}")
        order = _ALIASES.get(str(config.kv_cache_layout), str(config.kv_cache_layout))
        if order not in SUPPORTED_ORDERS:
            raise _refuse(
                f"KV cache layout {config.kv_cache_layout!r} is not supported; supported: LBNHC (NHD), LBHNC (HND)"
            )
        if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0):
            raise _refuse(f"head_dim must be a positive integer, not {head_dim!r}")
        if order == "LBHNC" and head_dim is None:
            raise _refuse("KV cache layout LBHNC (HND) needs the model's head_dim in the tier's configuration")
        group = config.groups[0]
        layers, block_tokens = len(group.layer_names), int(group.tokens_per_block)
        per_block = int(config.worker_kv_bytes_per_block)
        copies = 1 if replicated else int(par.world_size)
        blocks = int(config.cache.blocks_per_chunk)
        dtype = DTYPES[dtype_name]
        if layers <= 0 or block_tokens <= 0 or per_block <= 0 or per_block % layers:
            raise _refuse(f"{per_block} KV bytes per block do not split into {layers} equal layer pages")
        page = per_block // layers
        run = 2 * head_dim * dtype.itemsize if head_dim else 2 * dtype.itemsize
        if page % (block_tokens * run):
            raise _refuse(
                f"a {page}-byte layer page is not {block_tokens} tokens of whole {run}-byte key/value runs "
                "(layers packed per block, or a quantized cache?)"
            )
        used = copies * blocks * per_block
        if row_stride != -(-used // mmap.PAGESIZE) * mmap.PAGESIZE:  # vLLM pads each row to a memory page
            raise _refuse(f"offload rows are {row_stride} bytes, but {copies} worker(s) x {blocks} block(s) x {per_block} bytes need {used}")
        return cls(dtype, order, copies, layers, blocks, block_tokens, page, head_dim, row_stride)

    # -- shapes ---------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        return self.blocks * self.block_tokens

    @property
    def used_bytes(self) -> int:
        return self.copies * self.layers * self.blocks * self.page_bytes

    @property
    def num_arrays(self) -> int:
        """Layers of the cache one row becomes: one per worker copy and model layer."""
        return self.copies * self.layers

    @property
    def array_shape(self) -> tuple[int, int, int]:
        """``[kv_heads, tokens, head_dim]`` of each key and value array (one "head" without ``head_dim``)."""
        token_elems = self.page_bytes // self.dtype.itemsize // self.block_tokens
        if self.head_dim is None:
            return 1, self.tokens, token_elems // 2
        return token_elems // (2 * self.head_dim), self.tokens, self.head_dim

    def split(self, flat: np.ndarray, dim: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """Keys and values ``[kv_heads, tokens, dim]`` of every array of a row, from the row's first
        ``used_bytes`` as elements (``dim`` left out), or as runs of ``head_dim`` elements (``dim=1``).

        The same cut serves the data (to encode) and an index of runs (``row_offsets``: where
        each decoded run goes back).
        """
        heads, tokens, full = self.array_shape
        dim = full if dim is None else dim
        seg = flat.size // self.num_arrays
        out = []
        for i in range(self.num_arrays):
            part = flat[i * seg:(i + 1) * seg]
            if self.head_dim is None:  # LBNHC: tokens x (halves of each token's run)
                rows = part.reshape(tokens, 2 * dim)
                out.append((rows[None, :, :dim], rows[None, :, dim:]))
            elif self.order == "LBNHC":  # [tokens, heads, K|V, dim]
                x = part.reshape(tokens, heads, 2, dim)
                out.append((x[:, :, 0].transpose(1, 0, 2), x[:, :, 1].transpose(1, 0, 2)))
            else:  # LBHNC: [blocks, heads, block_tokens, K|V, dim]
                x = part.reshape(self.blocks, heads, self.block_tokens, 2, dim)
                k, v = (x[:, :, :, kv].transpose(1, 0, 2, 3).reshape(heads, tokens, dim) for kv in (0, 1))
                out.append((k, v))
        return out

    def row_offsets(self) -> np.ndarray:
        """Byte offsets ``[2 * num_arrays, kv_heads, tokens]`` of every decoded run within a row."""
        run = self.array_shape[2]
        index = np.arange(self.used_bytes // self.dtype.itemsize // run, dtype=np.int64)
        starts = [a[:, :, 0] for pair in self.split(index, dim=1) for a in pair]
        return np.stack(starts) * (run * self.dtype.itemsize)

    def signature(self) -> str:
        """What a stored chunk's arrays depend on besides model and recipe (part of its key)."""
        return f"{self.order}:{self.copies}x{self.layers}x{self.blocks}x{self.page_bytes}:hd={self.head_dim or '-'}"


def chunk_namer(config: Any, recipe: str, layout: RowLayout, model: str | None = None) -> ChunkNamer:
    """The store keys of the chunks of vLLM's ``OffloadingConfig`` ``config``, coded with ``recipe`` in rows of
    ``layout`` (``kvtool.entries.names.ChunkNamer``); ``model`` names the model instead of vLLM's own name."""
    return ChunkNamer(
        model or str(config.model.name), str(config.model.dtype), recipe,
        f"{config.cache.tokens_per_hash}/{layout.block_tokens}/{layout.tokens}",
        parallel_part(config, layout), layout.signature(),
    )


def parallel_part(config: Any, layout: RowLayout) -> str:
    """What a chunk's key binds of the parallel layout: only what changes the row's bytes.

    A row of one copy (one worker, or vLLM's ``replicated_layout``, where every worker
    holds the same bytes, such as an MLA latent) holds the whole model's KV of its
    blocks, the same bytes at any tensor-parallel size: it keeps the key a single
    worker's chunk has always had, so servers of every TP size share it. A row of one
    cell per worker holds each worker's shard of the heads: it binds world and TP size.
    """
    if layout.copies == 1:
        return "world=1,tp=1,copies=1"
    par = config.parallel
    return f"world={par.world_size},tp={par.tp_size},copies={layout.copies}"
