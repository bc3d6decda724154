"""vLLM's CPU kernels' block tiles against kvtool's views of them, with vLLM's own ``cpu_attn_reshape_and_cache``.

Each kernel (``vec``, ``vec16``, ``amx``; bf16 and fp8 caches) writes known
tokens into a paged cache as vLLM's forward pass does; kvtool's views must
read back exactly those tokens, and writing the tokens through them must give
the bytes vLLM's kernel wrote. The ``amx`` layout is data movement only, so it
is checked on any x86 CPU. Run in the vLLM environment::

    .venv-vllm/bin/python -m pytest tests/vllm_e2e/test_cpu_tiles.py
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: create its environment with scripts/vllm-env.sh")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from kvtool.integrations.vllm.cpu_tiles import attention_isa, column_major, tile_orders  # noqa: E402
from kvtool.integrations.vllm.paged import from_numpy, gather_blocks, kv_views, scatter_blocks, typed  # noqa: E402

BLOCK, HEADS, BLOCKS = 128, 2, 4
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CASES = [("vec", "auto", 64), ("vec", "auto", 128), ("vec16", "auto", 80), ("amx", "auto", 64), ("amx", "auto", 128),
         ("vec", "fp8_e4m3", 64), ("vec", "fp8_e5m2", 64), ("amx", "fp8_e4m3", 64)]


def written_by_vllm(isa: str, cache_dtype: str, dim: int, keys: torch.Tensor, values: torch.Tensor,
                    slots: torch.Tensor) -> torch.Tensor:
    """A ``[blocks, heads, block, 2 * dim]`` paged cache into which vLLM's kernel ``isa`` wrote the tokens."""
    fp8 = cache_dtype in FP8
    cache = torch.zeros((BLOCKS, HEADS, BLOCK, 2 * dim), dtype=torch.uint8 if fp8 else torch.bfloat16)
    key_cache, value_cache = cache.view(BLOCKS, HEADS, 2 * BLOCK, dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa, kv_cache_dtype=cache_dtype)
    return cache


def tokens(n: int, dim: int, seed: int) -> torch.Tensor:
    """``[n, heads, dim]`` bf16 tokens in steps of 1/2 within +-4: exact in every KV dtype (fp8 too)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(-8, 9, (n, HEADS, dim), generator=generator) / 2).to(torch.bfloat16)


@pytest.mark.parametrize(("isa", "cache_dtype", "dim"), CASES)
def test_views_read_and_write_the_tokens_vllm_kernels_tile(isa: str, cache_dtype: str, dim: int) -> None:
    keys, values = tokens(2 * BLOCK, dim, 1), tokens(2 * BLOCK, dim, 2)
    block_ids = [3, 1]
    slots = torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in block_ids])
    cache = written_by_vllm(isa, cache_dtype, dim, keys, values, slots)
    dtype = {"auto": "bf16"}.get(cache_dtype, cache_dtype)
    orders = tile_orders(isa, torch.bfloat16, cache_dtype, BLOCK, dim)
    key_view, value_view = kv_views(typed(cache, dtype), "CPU_ATTN", dim, BLOCK, orders)

    torch_dtype = FP8.get(cache_dtype, torch.bfloat16)
    for view, want in ((key_view, keys), (value_view, values)):
        got = from_numpy(gather_blocks(view, block_ids), torch_dtype)  # [heads, tokens, dim]
        assert torch.equal(got.float(), want.permute(1, 0, 2).float())

    rewritten = torch.zeros_like(cache)
    key_back, value_back = kv_views(typed(rewritten, dtype), "CPU_ATTN", dim, BLOCK, orders)
    for view, view_back in ((key_view, key_back), (value_view, value_back)):
        scatter_blocks(view_back, block_ids, from_numpy(gather_blocks(view, block_ids), torch_dtype))
    assert torch.equal(rewritten, cache)  # the bytes vLLM's kernel wrote, every tile of every block


def test_the_kernels_that_reorder_are_known() -> None:
    """The vec kernels keep keys column-major and values as rows; amx reorders both (vLLM 0.32)."""
    for isa, dim in (("vec", 64), ("vec16", 80)):
        key, value = tile_orders(isa, torch.bfloat16, "auto", BLOCK, dim)
        assert value is None and key is not None and torch.equal(key, column_major(BLOCK, dim))
    assert all(order is not None for order in tile_orders("amx", torch.bfloat16, "auto", BLOCK, 64))


def test_the_isa_is_vllms_choice() -> None:
    assert attention_isa(torch.bfloat16, BLOCK, 80, "auto") == "vec16"  # a head size of 16 but not 32 channels
    assert attention_isa(torch.bfloat16, BLOCK, 64, "auto") in ("vec", "amx")
