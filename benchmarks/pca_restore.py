"""The pca stage's restore through the container: the batch path against the per-chunk path, on the same entry.

    python benchmarks/pca_restore.py [--rounds 9] [--step 0.32] [--baseline-core SO]

One 256-token SmolLM2 cache (all 30 layers of samples/prose.safetensors, bf16, 5.9 MB: one connector entry)
coded with ``pca:BASIS,step=S|zstd:1``, the basis learnt from samples/code.safetensors (keys de-rotated);
restored each of these ways, rounds alternated so that the machine's load falls on all alike, one thread:

- ``read``: ``KvzReader.read`` into one array, by the pipeline the reader picks (the batch where the core is
  built) and by the per-chunk path;
- ``rows``: into rows of shuffled paged blocks (vLLM's CPU pages of 16 tokens, as the connector restores),
  both paths; and ``rows, another entry each time``: 40 entries of the same tokens at other positions in
  turn, each read parsing its own header and recipe, as a connector's entries come out of a store.

Each reports CPU ms per entry (the median of the rounds) and CPU seconds per GB of restored cache. With
``--baseline-core``, another build of the core (``benchmarks/cores.py``) restores the same ways (the per-chunk
ones alone where it has no batch kernel), in alternate rounds, from an entry of its own (the same bytes under another header: its coders are its build's).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

from cores import load_core, use_core
from kvtool import _native
from kvtool.cache import KVCache
from kvtool.destinations import PagedBlocks
from kvtool.kvz import KvzReader, encode_cache
from kvtool.kvz.pipeline import PerChunk
from kvtool.modeldict import registry
from kvtool.modeldict.basis_train import train_basis

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16


def cpu_ms(fn) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--step", type=float, default=0.32)
    parser.add_argument("--baseline-core", type=Path, help="another build's _core*.so, timed in alternate rounds")
    args = parser.parse_args()
    basis = train_basis([KVCache.load(ROOT / "samples" / "code.safetensors")], rope_theta=1e5)
    registry.register(basis)
    cache = KVCache.load(ROOT / "samples" / "prose.safetensors", tokens=slice(0, 256))
    recipe = f"pca:{basis.id},step={args.step}|zstd:1"
    cores = {"": _native.core()}
    if args.baseline_core:
        cores = {"baseline ": load_core(args.baseline_core), **cores}
    blobs = {}
    for i, label in enumerate(cores):  # an entry per core: coders are built by the core that first reads them
        use_core(cores[label])
        blobs[label] = encode_cache(KVCache(cache.keys, cache.values, cache.model, {"copy": i}), recipe)
    layers, (heads, tokens, dim) = len(cache.keys), cache.keys[0].shape
    blocks = tokens // BLOCK
    pages = np.zeros((layers, blocks + 4, heads, 2 * BLOCK, dim), cache.dtype.numpy)
    ids = [int(i) for i in np.random.default_rng(0).permutation(blocks + 4)[:blocks]]
    layer_bytes = pages[0].nbytes
    destination = PagedBlocks([pages.reshape(-1).view(np.uint8)], [0] * (2 * layers),
                              [(i // 2) * (layer_bytes // 2) + (i % 2) * BLOCK * dim for i in range(2 * layers)],
                              [(heads * 2 * BLOCK * dim, 2 * BLOCK * dim, dim)] * (2 * layers), heads, BLOCK, 2, ids)

    def reader(label: str, batch: bool) -> KvzReader:
        opened = KvzReader.from_bytes(blobs[label])
        if not batch:
            opened._pipeline = PerChunk(opened.header)
        return opened

    ways: dict[str, tuple[str, Callable[[], object]]] = {}
    for label in cores:  # a build from before the batch kernel has the per-chunk path alone
        batched = hasattr(cores[label], "pca_decode_run")
        for path in ("batch", "per-chunk") if batched else ("per-chunk",):
            ways[f"{label}read, {path}"] = (label, lambda label=label, b=path == "batch": reader(label, b).read(threads=1))
            ways[f"{label}rows, {path}"] = (
                label, lambda label=label, b=path == "batch": reader(label, b).read_into(destination, threads=1))
    # entries as a store holds them, each under a header of its own (another position in the sequence): a reader
    # parses each one's recipe, so what it builds per recipe counts too
    fresh = [encode_cache(KVCache(cache.keys, cache.values, cache.model, token_start=BLOCK * (i + 1)), recipe)
             for i in range(40)]
    turn = iter(range(1 << 30))
    ways["rows, another entry each time"] = (
        "", lambda: KvzReader.from_bytes(fresh[next(turn) % len(fresh)]).read_into(destination, threads=1))
    for label in cores:
        use_core(cores[label])
        first = reader(label, hasattr(cores[label], "pca_decode_run"))
        assert first.read().equal_bits(reader(label, False).read())
        print(f"{label or 'this tree'}: pca step {args.step}, ratio {cache.nbytes / len(blobs[label]):.2f}x, "
              f"pipeline {type(first._pipeline).__name__}, core {_native.status()}")
    times: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(args.rounds + 1):  # the first round warms
        for name, (label, fn) in ways.items():
            use_core(cores[label])
            spent = cpu_ms(fn)
            if round_:
                times[name].append(spent)
    print("| way | CPU ms / entry | range | CPU s / GB |")
    print("|---|---|---|---|")
    for name, t in times.items():
        median = statistics.median(t)
        print(f"| {name} | {median:.1f} | {min(t):.1f}-{max(t):.1f} | {median / 1e3 / (cache.nbytes / 1e9):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
