"""One connector entry decoded a few times, for an instruction count of the restore kernel (callgrind).

    PYTHONPATH=TREE valgrind --tool=callgrind --collect-atstart=no --toggle-collect=py_decode_rows \
        python benchmarks/entry_decode.py --way decoder --repeat 2

The entry is ``benchmarks/seam_bench.py``'s: 256 tokens of all 30 layers of samples/prose.safetensors (bf16,
5.9 MB, 60 chunks) stored with ``--recipe``. ``decoder`` restores it through the pipeline into shuffled
paged blocks (the core's ``decode_rows``: both checksums, every row placed); ``codec`` decodes each chunk
into its own array (the core's ``exphuff_decode`` for exphuff; no checksums). kvtool comes from
``PYTHONPATH``, so the same command counts another tree's core; the result is checked either way.
Instruction counts do not depend on the machine's load, unlike the times of seam_bench.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from kvtool.cache import KVCache
from kvtool.destinations import PagedBlocks
from kvtool.entries import put_cache
from kvtool.kvz import KvzReader
from kvtool.kvz.reader import pipeline_for
from kvtool.store import open_store

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--way", choices=("decoder", "codec"), default="decoder")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--recipe", default="exphuff")
    args = parser.parse_args()
    cache = KVCache.load(ROOT / "samples" / "prose.safetensors", tokens=slice(0, 256))
    layers, (heads, tokens, dim) = len(cache.keys), cache.keys[0].shape
    store = open_store("memory://")
    assert put_cache(store, "entry", cache, args.recipe).stored
    blob = bytes(store.fetch("entry").entry.value)
    reader = KvzReader.from_bytes(blob)
    blocks = tokens // BLOCK
    pages = [np.zeros((blocks + 4, heads, 2 * BLOCK, dim), np.uint16) for _ in range(layers)]
    ids = [int(i) for i in np.random.default_rng(0).permutation(blocks + 4)[:blocks]]
    destination = PagedBlocks([p.reshape(-1).view(np.uint8) for p in pages], [i // 2 for i in range(2 * layers)],
                              [0 if i % 2 == 0 else BLOCK * dim for i in range(2 * layers)],
                              [(heads * 2 * BLOCK * dim, 2 * BLOCK * dim, dim)] * (2 * layers), heads, BLOCK, 2, ids)
    selected = reader._blocks(list(range(2 * layers)), 0, tokens)
    pipeline = pipeline_for(reader.header)
    codec = reader.recipe.codec
    chunks = [(blob[int(e["offset"]):int(e["offset"]) + int(e["stored_len"])], np.empty((heads, tokens, dim), cache.dtype.numpy))
              for e in reader.index]
    for _ in range(args.repeat):
        if args.way == "decoder":
            pipeline.decode(reader._source, selected, destination, threads=1)
        else:
            for chunk, array in chunks:
                codec.decode_array(chunk, array.shape, array.dtype, out=array)
    if args.way == "decoder":
        for i, key in enumerate(cache.keys):
            rows = pages[i].reshape(blocks + 4, heads, 2, BLOCK, dim)[ids][:, :, 0]  # [blocks, heads, BLOCK, dim]
            assert rows.transpose(1, 0, 2, 3).reshape(heads, tokens, dim).tobytes() == key.tobytes()
    else:
        assert all(any(a.tobytes() == t.tobytes() for t in cache.keys + cache.values) for _, a in chunks)
    print(f"{args.way}: {len(reader.index)} chunks, {cache.nbytes} bytes, decoded {args.repeat} times, equal to the cache")


if __name__ == "__main__":
    main()
