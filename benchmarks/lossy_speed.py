"""How fast lossy recipes write and restore, against the lossless default (BENCHMARKS.md, "Lossy recipes", "Speed").

    python benchmarks/lossy_speed.py out/code-4096.safetensors exphuff 'int:6,group=64|zstd:3'
    python benchmarks/lossy_speed.py --tokens 1024 --rounds 5 out/GPL-3.safetensors exphuff \\
        'pca:out/basis-without-GPL-3.kvd,step=0.32|zstd:1'
    KVTOOL_NATIVE=0 python benchmarks/lossy_speed.py ...   # the numpy reference

Each recipe's .kvz (256-token chunks, as the store keeps them) is written and restored, rounds alternated
between the recipes so that the machine's load falls on all alike, on one thread; CPU seconds per GB of
cache (the median of the rounds), so a busy machine moves them less:

- ``write``: ``encode_cache``, the cache to the container's bytes;
- ``read``: ``KvzReader.read``, the container's bytes into fresh arrays;
- ``restore``: ``kvtool.entries.restore_into`` from a memory store into paged blocks laid out as vLLM's CPU
  pages (a block's key rows, then its value rows; the blocks in shuffled order), the path every
  integration takes out of a store; the reader's pipeline for it is named (``NativeBatch``, ``IntBatch``:
  the native batch kernels; ``PerChunk``: each block's planes, then its layouts' ``inverse_into``), and
  the pages are checked against ``read``'s arrays.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np

from kvtool.cache import KVCache
from kvtool.destinations import PagedBlocks
from kvtool.entries import Expected, put_cache, restore_into
from kvtool.kvz import KvzReader, encode_cache
from kvtool.kvz.reader import pipeline_for
from kvtool.store import open_store

CHUNK_TOKENS = 256
BLOCK = 16


def paged_destination(cache: KVCache, seed: int = 0) -> tuple[PagedBlocks, list[np.ndarray], list[int]]:
    """Empty pages of vLLM's CPU layout (per layer ``[blocks, heads, 2 * BLOCK, dim]``: a block's key rows, then its
    value rows) for ``cache``'s tokens, the destination that fills them and the (shuffled) blocks it fills."""
    layers, (heads, tokens, dim) = cache.num_layers, cache.keys[0].shape
    blocks = -(-tokens // BLOCK)
    itemsize = cache.dtype.numpy.itemsize
    pages = [np.zeros((blocks + 4) * heads * 2 * BLOCK * dim * itemsize, np.uint8) for _ in range(layers)]
    ids = [int(i) for i in np.random.default_rng(seed).permutation(blocks + 4)[:blocks]]
    destination = PagedBlocks(pages, [i // 2 for i in range(2 * layers)], [0 if i % 2 == 0 else BLOCK * dim for i in range(2 * layers)],
                              [(heads * 2 * BLOCK * dim, 2 * BLOCK * dim, dim)] * (2 * layers), heads, BLOCK, itemsize, ids)
    return destination, pages, ids


def paged_tensors(pages: list[np.ndarray], cache: KVCache, destination_ids: list[int]) -> list[np.ndarray]:
    """The keys and values of each layer, ``[heads, tokens, dim]``, read back out of ``pages``."""
    heads, tokens, dim = cache.keys[0].shape
    out = []
    for page in pages:
        blocks = page.view(cache.dtype.numpy).reshape(-1, heads, 2 * BLOCK, dim)[destination_ids]
        for half in (slice(0, BLOCK), slice(BLOCK, 2 * BLOCK)):
            out.append(blocks[:, :, half].transpose(1, 0, 2, 3).reshape(heads, -1, dim)[:, :tokens])
    return out


def cpu_s_per_gb(fn: Callable[[], object], nbytes: int) -> float:
    started = time.process_time()
    fn()
    return (time.process_time() - started) / nbytes * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", help="a .safetensors cache")
    parser.add_argument("recipes", nargs="+")
    parser.add_argument("--tokens", type=int, default=0, help="the cache's first TOKENS tokens (default: all)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cache = KVCache.load(args.cache, tokens=slice(0, args.tokens) if args.tokens else None)
    store = open_store("memory://")
    expected = Expected(cache.num_layers, cache.keys[0].shape, cache.dtype.name)
    blobs, ways = {}, {}
    for spec in args.recipes:
        blobs[spec] = encode_cache(cache, spec, chunk_tokens=CHUNK_TOKENS, threads=1)
        if not put_cache(store, spec, cache, spec, chunk_tokens=CHUNK_TOKENS).stored:
            raise SystemExit(f"{spec}: the memory store did not take the entry")
        destination, pages, ids = paged_destination(cache)

        def restore(spec: str = spec, destination: PagedBlocks = destination) -> None:
            if not restore_into(store, spec, expected, destination).ok:
                raise SystemExit(f"{spec}: the restore missed")

        ways[spec] = {
            "write": lambda spec=spec: encode_cache(cache, spec, chunk_tokens=CHUNK_TOKENS, threads=1),
            "read": lambda spec=spec: KvzReader.from_bytes(blobs[spec]).read(threads=1),
            "restore": restore,
        }
        for fn in ways[spec].values():  # warm: dictionaries, coder tables, first-touch pages
            fn()
        read = KvzReader.from_bytes(blobs[spec]).read(threads=1)
        if any(a.tobytes() != b.tobytes() for a, b in zip(paged_tensors(pages, cache, ids), [t for _, _, t in read.tensors()])):
            raise SystemExit(f"{spec}: the pages hold other values than the reader's arrays")
    times: dict[str, dict[str, list[float]]] = {spec: {way: [] for way in ways[spec]} for spec in args.recipes}
    for _ in range(args.rounds):
        for spec in args.recipes:
            for way, fn in ways[spec].items():
                times[spec][way].append(cpu_s_per_gb(fn, cache.nbytes))
    print(f"{cache.num_layers} layers x {cache.keys[0].shape}, {cache.dtype.name}, {cache.nbytes / 1e6:.1f} MB; "
          f"{args.rounds} rounds, one thread; CPU s/GB of cache (median, range)")
    print("| recipe | ratio | write | read | restore into paged blocks | restore path |")
    print("|---|---|---|---|---|---|")
    for spec in args.recipes:
        path = type(pipeline_for(KvzReader.from_bytes(blobs[spec]).header)).__name__
        cells = [f"{statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})" for t in times[spec].values()]
        print(f"| `{spec}` | {cache.nbytes / len(blobs[spec]):.2f} | " + " | ".join(cells) + f" | {path} |")


if __name__ == "__main__":
    main()
