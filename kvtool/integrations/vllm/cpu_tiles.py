"""Where vLLM's CPU backend puts each token's keys and values inside a block, learnt from vLLM's own kernel.

vLLM's CPU attention (``CPU_ATTN``) gives each block and KV head a key tile
and a value tile of ``block_size * head_dim`` elements, and lays them out for
the instruction set its kernels use: the ``vec`` and ``vec16`` kernels keep keys
column-major (``[head_dim, block_size]``: a token's channels ``block_size``
apart), ``amx`` packs keys and values in pairs for its tile instructions. A
connector that copied the tiles as ``[block_size, head_dim]`` rows would store
bytes that are not the tokens' keys: a lossless round trip through the same
kernel still gives them back, but a lossy recipe, an entry read by another
engine or by ``kvtool`` itself, sees scrambled keys.

``tile_orders`` asks vLLM's own ``cpu_attn_reshape_and_cache`` where each
(token, channel) of a tile lands: it writes a scratch block whose values are
the base-8 digits of each element's logical index (exact in every KV dtype
vLLM's CPU backend keeps, fp8 included) and reads the digits back. The answer
is a permutation, or None where the tile is plain rows. ``TiledBlocks`` then
gathers and puts whole blocks through that permutation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from kvtool.errors import UsageError
from kvtool.torchbits import as_bits

#: Values 0..7 are exact in bf16, fp16, fp32, fp8 e4m3 and e5m2: one octal digit of an index per probe.
_DIGIT_BITS = 3


@dataclass(frozen=True)
class TiledBlocks:
    """One layer's keys or values in vLLM's CPU pages, whose tiles are not ``[block_size, head_dim]`` rows.

    ``raw`` is the ``[num_blocks, heads, block_size, head_dim]`` view of the tiles' storage read as rows;
    ``offsets[t * head_dim + d]`` is where (token ``t``, channel ``d``) lies among a tile's elements. A tile
    whose order is a stride per token and one per channel (column-major keys) is read and written through a
    strided view of the tokens, a copy of torch's own; any other order through the permutation.
    """

    raw: torch.Tensor
    offsets: torch.Tensor  # long [block_size * head_dim]

    @property
    def shape(self) -> torch.Size:
        return self.raw.shape

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def dtype(self) -> torch.dtype:
        return self.raw.dtype

    @functools.cached_property
    def tokens(self) -> torch.Tensor | None:
        """The tiles as a strided ``[num_blocks, heads, block_size, head_dim]`` view of tokens, where the order has one."""
        block, dim = self.raw.shape[2:]
        per_token, per_channel = int(self.offsets[dim]) if block > 1 else 0, int(self.offsets[1]) if dim > 1 else 0
        affine = torch.arange(block)[:, None] * per_token + torch.arange(dim)[None, :] * per_channel
        if not torch.equal(affine.reshape(-1), self.offsets):
            return None
        return self.raw.as_strided(self.raw.shape, (*self.raw.stride()[:2], per_token, per_channel))

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Blocks ``block_ids`` as ``[n, heads, block_size, head_dim]`` tokens (a copy)."""
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.raw.device)
        if self.tokens is not None:
            return as_bits(self.tokens).index_select(0, index).view(self.raw.dtype)
        tiles = as_bits(self.raw).index_select(0, index)
        n, heads, block, dim = tiles.shape
        return tiles.reshape(n, heads, block * dim)[:, :, self.offsets].reshape(n, heads, block, dim).view(self.raw.dtype)

    def put(self, index: torch.Tensor, blocks: torch.Tensor) -> None:
        """Write ``[n, heads, block_size, head_dim]`` token ``blocks`` into the tiles of blocks ``index``."""
        source = as_bits(blocks.to(self.raw.device))
        if self.tokens is not None:
            as_bits(self.tokens).index_copy_(0, index, source)
            return
        n, heads, block, dim = blocks.shape
        raw = as_bits(self.raw)
        tiles = torch.empty((n, heads, block * dim), dtype=raw.dtype, device=raw.device)
        tiles[:, :, self.offsets] = source.reshape(n, heads, block * dim)
        raw.index_copy_(0, index, tiles.view(n, heads, block, dim))


def column_major(block_size: int, head_dim: int) -> torch.Tensor:
    """The order of a ``[head_dim, block_size]`` tile (vLLM's ``vec`` kernels' keys) as ``TiledBlocks.offsets``."""
    return (torch.arange(head_dim)[None, :] * block_size + torch.arange(block_size)[:, None]).reshape(-1)


def attention_isa(model_dtype: torch.dtype, block_size: int, head_dim: int, cache_dtype: str) -> str:
    """The instruction set vLLM's CPU backend picks for these layers (as its metadata builder does)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as exc:  # another vLLM release: its tile layout is unknown here
        raise UsageError(f"kvtool cannot tell how this vLLM's CPU backend lays out its KV blocks ({exc}); "
                         "see docs/VLLM.md for the vLLM releases kvtool supports") from None
    return str(_get_attn_isa(model_dtype, block_size, head_dim, cache_dtype))


@functools.cache
def tile_orders(isa: str, model_dtype: torch.dtype, cache_dtype: str, block_size: int,
                head_dim: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The key and value tile permutations (``TiledBlocks.offsets``) of vLLM's CPU kernel ``isa``; None for a tile
    that is plain ``[block_size, head_dim]`` rows. ``UsageError`` where the kernel writes no permutation."""
    from vllm import _custom_ops as ops

    elements = block_size * head_dim
    fp8 = cache_dtype.startswith("fp8")
    index = torch.arange(elements, dtype=torch.long)
    landed = torch.zeros((2, elements), dtype=torch.long)
    for digit in range(-(-max(elements - 1, 1).bit_length() // _DIGIT_BITS)):
        shift = digit * _DIGIT_BITS
        probe = ((index >> shift) & 7).to(model_dtype).view(block_size, 1, head_dim)  # [tokens, heads, dim]
        cache = torch.zeros((1, 1, block_size, 2 * head_dim), dtype=torch.uint8 if fp8 else model_dtype)
        key_cache, value_cache = cache.view(1, 1, 2 * block_size, head_dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(probe, probe.clone(), key_cache, value_cache, torch.arange(block_size), isa,
                                       kv_cache_dtype=cache_dtype)
        stored = cache.view(_FP8[cache_dtype]) if fp8 else cache
        digits = stored.reshape(2, elements).to(torch.float32).round().to(torch.long)
        landed |= digits << shift
    orders = []
    for kind, logical in zip(("key", "value"), landed):
        if not torch.equal(torch.sort(logical).values, index):
            raise UsageError(f"vLLM's CPU kernel {isa!r} does not lay a block's {kind}s out as a permutation of its "
                             f"tokens' values ({block_size} tokens x {head_dim}); kvtool cannot read its blocks")
        offsets = torch.empty_like(index)
        offsets[logical] = index  # logical element -> where it lies in the tile
        orders.append(None if torch.equal(offsets, index) else offsets)
    return orders[0], orders[1]


_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
