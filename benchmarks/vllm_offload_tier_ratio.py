"""What kvtool's tier under vLLM's offloading stores per chunk, against the raw rows vLLM's ``fs`` tier writes.

    python benchmarks/vllm_offload_tier_ratio.py [RECIPE ...]

The real caches in samples/ are laid out as vLLM's CUDA backends page them
(``LBNHC``: per token, each head's keys then values; every layer of a chunk in one
row, as vLLM's CPU tier keeps it) and stored through the tier's own path
(``RowLayout`` + ``save_row``) into a memory store, for chunks of 32 and 256 tokens
(vLLM's ``block_size`` option), with and without ``head_dim``. Prints one row per
case: raw bytes, stored bytes (the whole store entry: record, .kvz header and
index), ratio, and encode speed on this machine.
"""

from __future__ import annotations

import mmap
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import kvtool
from kvtool.integrations.vllm_offload.chunks import save_row
from kvtool.integrations.vllm_offload.rows import RowLayout
from kvtool.store import open_store

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16


def rows_of(cache: kvtool.KVCache, tokens: int) -> np.ndarray:
    """Every chunk of ``tokens`` tokens of the cache (all its layers) as one LBNHC row."""
    kv = np.stack([np.stack(cache.keys), np.stack(cache.values)], axis=3)  # [layers, heads, tokens, 2, dim]
    layers, heads, total, _, dim = kv.shape
    chunks = total // tokens
    rows = kv[:, :, :chunks * tokens].reshape(layers, heads, chunks, tokens, 2, dim).transpose(2, 0, 3, 1, 4, 5)
    return np.ascontiguousarray(rows).reshape(chunks, -1).view(np.uint8)


def layout_for(cache: kvtool.KVCache, tokens: int, head_dim: int | None) -> RowLayout:
    heads, _, dim = cache.keys[0].shape
    per_block = cache.num_layers * BLOCK * heads * 2 * dim * cache.dtype.itemsize
    used = per_block * tokens // BLOCK
    config = SimpleNamespace(
        canonical_layout=False, kv_cache_layout="LBNHC", worker_kv_bytes_per_block=per_block,
        groups=(SimpleNamespace(tokens_per_block=BLOCK, layer_names=tuple(range(cache.num_layers))),),
        model=SimpleNamespace(name="bench", dtype="bfloat16"),
        cache=SimpleNamespace(tokens_per_hash=BLOCK, blocks_per_chunk=tokens // BLOCK),
        parallel=SimpleNamespace(world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1),
    )
    return RowLayout.from_config(config, -(-used // mmap.PAGESIZE) * mmap.PAGESIZE, False, head_dim)


def main() -> None:
    recipes = sys.argv[1:] or ["exphuff", "zstd:3", "byteplane|zstd:1"]
    print(f"{'sample':<7} {'recipe':<17} {'tokens':>6} {'head_dim':>8} {'raw MB':>8} {'stored MB':>9} {'ratio':>6} {'MB/s':>6}")
    for name in ("code", "prose"):
        cache = kvtool.load(ROOT / "samples" / f"{name}.safetensors")
        for recipe in recipes:
            for tokens in (32, 256):
                for head_dim in (cache.keys[0].shape[2], None):
                    layout = layout_for(cache, tokens, head_dim)
                    data = rows_of(cache, tokens)
                    region = np.zeros((len(data), layout.row_stride), np.uint8)
                    region[:, :layout.used_bytes] = data
                    with open_store("memory://") as store:
                        start = time.perf_counter()
                        for row in range(len(region)):
                            assert save_row(store, f"c{row}", region, row, layout, recipe)
                        seconds = time.perf_counter() - start
                        stored = sum(store.info(k).size for k in store.keys())
                    raw = data.size
                    print(f"{name:<7} {recipe:<17} {tokens:>6} {head_dim or '-':>8} {raw / 1e6:>8.2f} "
                          f"{stored / 1e6:>9.2f} {raw / stored:>6.3f} {raw / seconds / 1e6:>6.0f}")


if __name__ == "__main__":
    main()
