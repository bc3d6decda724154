"""What the way out of a store costs each integration, over the decoder alone, on the same entries.

    python benchmarks/seam_bench.py [--rounds 7] [--recipe exphuff] [--json out/seam.json] [--baseline-core SO]

One real SmolLM2 cache of 256 tokens (all 30 layers of samples/prose.safetensors, bf16, 5.9 MB: the
size of one LMCache chunk or one connector entry of 16 blocks of 16 tokens), stored in a memory store,
restored each of these ways, rounds alternated so that the machine's load falls on all alike:

- ``codec``: the recipe's codec alone (``decode_array``), each of the entry's chunks into its own
  ``[heads, tokens, dim]`` array: the decoder's time on the entry;
- ``decoder``: the recipe's native kernel alone: the entry's chunks, already parsed, decoded into rows of
  paged blocks (checksums included; what no integration can beat);
- ``read``: the container from the entry's bytes into one array (``KvzReader.read``);
- ``lmcache``: the L2 adapter's load of one object (``entries.restore_into`` into the object's rows);
- ``connector``: the vLLM connector's restore of one entry into CPU paged tensors (``transfer.Restore``,
  before the forward pass), from the store; ``connector-vec`` the same into pages whose keys are
  column-major, as vLLM's CPU ``vec`` kernels keep them (decoded into staging, then reordered into the pages);
- ``tier``: the vLLM offload tier's load of one row (``load_row``).

Each reports CPU ms per entry (the median of the rounds, one thread) and its ratio to ``codec``. With
``--baseline-core``, another build of kvtool's core (its ``_core*.so``, built from an earlier commit with
``python setup.py build_ext --inplace``) runs every way too, in the same process, rounds alternated with this
tree's core: a change to the core timed before and after on the same machine at the same moments.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from cores import load_core, use_core  # noqa: E402 (benchmarks/cores.py)
from kvtool import _native  # noqa: E402
from kvtool.cache import KVCache  # noqa: E402
from kvtool.destinations import PagedBlocks  # noqa: E402
from kvtool.entries import put_cache, restore_into  # noqa: E402
from kvtool.integrations.lmcache.chunks import ChunkLayout  # noqa: E402
from kvtool.integrations.vllm.plan import LoadJob  # noqa: E402
from kvtool.integrations.vllm.cpu_tiles import TiledBlocks, column_major  # noqa: E402
from kvtool.integrations.vllm.paged import gather_blocks  # noqa: E402
from kvtool.integrations.vllm.transfer import PagedLayers, Restore  # noqa: E402
from kvtool.integrations.vllm_offload.chunks import load_row  # noqa: E402
from kvtool.integrations.vllm_offload.rows import RowLayout  # noqa: E402
from kvtool.kvz import KvzReader  # noqa: E402
from kvtool.kvz.reader import pipeline_for  # noqa: E402
from kvtool.store import open_store  # noqa: E402

BLOCK = 16


def cpu_ms(fn: Callable[[], object]) -> float:
    start = time.thread_time()
    fn()
    return (time.thread_time() - start) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--recipe", default="exphuff")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--baseline-core", type=Path, help="another build's _core*.so, timed in alternate rounds")
    args = parser.parse_args()
    cores = {"": _native.core()}
    if args.baseline_core:
        cores = {"baseline ": load_core(args.baseline_core), **cores}

    cache = KVCache.load(ROOT / "samples" / "prose.safetensors", tokens=slice(0, 256))
    layers, (heads, tokens, dim) = len(cache.keys), cache.keys[0].shape
    store = open_store("memory://")
    assert put_cache(store, "connector", cache, args.recipe).stored
    blob = bytes(store.fetch("connector").entry.value)

    # the connector's paged tensors (vLLM's CPU layout: a block's key rows, then its value rows), shuffled blocks
    blocks = tokens // BLOCK
    pages = [torch.zeros(blocks + 4, heads, 2 * BLOCK, dim, dtype=torch.bfloat16) for _ in range(layers)]
    paged = PagedLayers([f"l{i}" for i in range(layers)], [p[:, :, :BLOCK] for p in pages],
                        [p[:, :, BLOCK:] for p in pages], BLOCK, torch.bfloat16)
    vec_pages = [torch.zeros_like(p) for p in pages]
    vec_paged = PagedLayers([f"l{i}" for i in range(layers)],
                            [TiledBlocks(p[:, :, :BLOCK], column_major(BLOCK, dim)) for p in vec_pages],
                            [p[:, :, BLOCK:] for p in vec_pages], BLOCK, torch.bfloat16)
    ids = [int(i) for i in np.random.default_rng(0).permutation(blocks + 4)[:blocks]]
    jobs = {"r": [LoadJob("connector", blocks, 0, ids)]}

    # the LMCache object: [2, layers, tokens, heads * dim]
    k = np.stack([a.transpose(1, 0, 2).reshape(tokens, -1) for a in cache.keys])
    v = np.stack([a.transpose(1, 0, 2).reshape(tokens, -1) for a in cache.values])
    obj = np.ascontiguousarray(np.stack([k, v])).reshape(-1).view(np.uint8)
    layout = ChunkLayout.of([(2, layers, tokens, heads * dim)], ["torch.bfloat16"], obj.nbytes)
    assert put_cache(store, "lmcache", layout.cache(obj, "m"), args.recipe).stored
    out = np.zeros_like(obj)

    # the offload tier's row: one worker, LBNHC pages of 16 tokens, head_dim given
    row_layout = RowLayout(cache.dtype, "LBNHC", 1, layers, blocks, BLOCK, BLOCK * heads * 2 * dim * 2, dim,
                           layers * blocks * BLOCK * heads * 2 * dim * 2)
    region = np.zeros((2, row_layout.row_stride), np.uint8)
    offsets = row_layout.row_offsets()
    flat = region[0, :row_layout.used_bytes].view(cache.dtype.numpy)
    for i, (kk, vv) in enumerate(row_layout.split(flat)):
        kk[...] = cache.keys[i]
        vv[...] = cache.values[i]
    assert put_cache(store, "tier", KVCache([a.copy() for a, _ in row_layout.split(flat)],
                                            [b.copy() for _, b in row_layout.split(flat)]), args.recipe).stored

    # the decoder alone: chunks parsed once, their kernel straight into the same paged rows
    reader = KvzReader.from_bytes(blob)
    storage = [p.reshape(-1).view(torch.uint8).numpy() for p in pages]
    destination = PagedBlocks(storage, [i // 2 for i in range(2 * layers)],
                              [0 if i % 2 == 0 else BLOCK * dim for i in range(2 * layers)],
                              [(heads * 2 * BLOCK * dim, 2 * BLOCK * dim, dim)] * (2 * layers), heads, BLOCK, 2, ids)
    selected = reader._blocks(list(range(2 * layers)), 0, tokens)

    codec = reader.recipe.codec
    chunks = [(blob[int(e["offset"]):int(e["offset"]) + int(e["stored_len"])], np.empty((heads, tokens, dim), cache.dtype.numpy))
              for e in reader.index]

    def codec_alone() -> None:
        for chunk, array in chunks:
            codec.decode_array(chunk, array.shape, array.dtype, out=array)

    pipelines = {}
    for label, module in cores.items():  # a pipeline holds the core it was built with
        use_core(module)
        pipelines[label] = pipeline_for(reader.header)
    active = {"pipeline": pipelines[""]}

    def switch(label: str) -> None:
        use_core(cores[label])
        active["pipeline"] = pipelines[label]

    def decoder() -> None:
        active["pipeline"].decode(reader._source, selected, destination, threads=1)

    def read() -> None:
        with KvzReader.from_bytes(blob) as r:
            r.read(threads=1)

    def lmcache() -> None:
        assert restore_into(store, "lmcache", layout.expected(), layout.destination(out)).ok

    def connector() -> None:
        restore = Restore(store, lambda e: e, paged, jobs)
        restore.start(background=False)
        assert restore.finish() == set()

    def connector_vec() -> None:
        restore = Restore(store, lambda e: e, vec_paged, jobs)
        restore.start(background=False)
        for index in range(layers):
            restore.copy_layer(index)
        assert restore.finish() == set()

    def tier() -> None:
        assert load_row(store, "tier", region, 1, row_layout, offsets)

    ways = {"codec": codec_alone, "decoder": decoder, "read": read, "lmcache": lmcache, "connector": connector,
            "connector-vec": connector_vec, "tier": tier}
    for label in cores:  # warm: tables, first-touch pages
        switch(label)
        for fn in ways.values():
            fn()
        assert out.tobytes() == obj.tobytes() and region[1].tobytes() == region[0].tobytes()
        for i in range(layers):  # the column-major pages hold the entry's tokens, and so do the row pages
            for view, want in ((vec_paged.keys[i], cache.keys[i]), (paged.keys[i], cache.keys[i])):
                assert gather_blocks(view, ids).tobytes() == np.ascontiguousarray(want).tobytes()
    times: dict[str, list[float]] = {label + name: [] for label in cores for name in ways}
    for _ in range(args.rounds):
        for label in cores:
            switch(label)
            for name, fn in ways.items():
                times[label + name].append(cpu_ms(fn))
    switch("")
    rows = [{"way": label + name, "cpu_ms_per_entry": statistics.median(t), "min_ms": min(t), "max_ms": max(t),
             "vs_codec": statistics.median(t) / statistics.median(times[label + "codec"]),
             "cpu_s_per_gb": statistics.median(t) / 1e3 / (cache.nbytes / 1e9)}
            for label in cores for name, t in ((name, times[label + name]) for name in ways)]
    print(f"recipe {args.recipe}, one entry of {cache.nbytes / 1e6:.1f} MB, {args.rounds} rounds, CPU ms (median), "
          f"core {_native.status()}:")
    print("| way | CPU ms / entry | range | CPU s / GB | vs codec |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['way']} | {r['cpu_ms_per_entry']:.2f} | {r['min_ms']:.2f}-{r['max_ms']:.2f} | {r['cpu_s_per_gb']:.3f} | "
              f"{r['vs_codec']:.2f}x |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"recipe": args.recipe, "raw_bytes": cache.nbytes, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
