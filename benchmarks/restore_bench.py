"""Restore speed and peak memory of a .kvz reader, through names every kvtool version has.

    python benchmarks/restore_bench.py [--repeat 5] [--tokens 1024] [--recipe exphuff ...]

On samples/code.safetensors tiled to ``--tokens`` tokens (30 layers, bf16), for each recipe:
``kvtool.load`` of the file (one thread), ``read_rows`` into vLLM-like paged blocks (16-token
blocks, keys and values of a layer in one flat array, shuffled), and for each, in a child process,
the peak of what it allocates (tracemalloc) over the decoded size. CPU seconds per GB of cache, least of ``--repeat``.
Run it from two checkouts (PYTHONPATH) to compare them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

import kvtool
from kvtool.cache import KVCache

RECIPES = ("exphuff", "ctxans", "channel-major|byteplane|zstd:1", "int:4,group=64|zstd:3", "int:6,group=64|zstd:3")
BLOCK = 16


def paged(reader):
    """Targets (one per layer: K blocks then V blocks) and row offsets of a shuffled page table."""
    heads, tokens, dim = reader.tensors[0][2]
    row = dim * reader.dtype.itemsize
    blocks = -(-tokens // BLOCK)
    table = np.random.default_rng(0).permutation(blocks)
    token = np.arange(tokens)
    layers = len(reader.layer_ids)
    targets = [np.zeros(2 * blocks * heads * BLOCK * row, np.uint8) for _ in range(layers)]
    rows = np.empty((2 * layers, heads, tokens), np.int64)
    for i in range(2 * layers):
        kv = i % 2
        block_base = (kv * blocks + table[token // BLOCK]) * heads * BLOCK
        rows[i] = ((block_base[None, :] + np.arange(heads)[:, None] * BLOCK + token % BLOCK) * row)
    return targets, rows, [i // 2 for i in range(2 * layers)]


def child(path: str, op: str) -> None:
    """Peak memory the operation allocates (tracemalloc: Python and numpy) over the decoded size."""
    reader = kvtool.open_kvz(path)
    if op == "load":
        tracemalloc.start()
        decoded = kvtool.load(path, threads=1).nbytes
    else:
        targets, rows, target_of = paged(reader)  # the targets are the caller's
        decoded = sum(t.nbytes for t in targets)
        tracemalloc.start()
        reader.read_rows(targets, rows, target_of)
    _, peak = tracemalloc.get_traced_memory()
    print(json.dumps({"peak_over_decoded": peak / max(decoded, 1)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--recipe", action="append", help="Only these recipes (repeatable).")
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    sample = KVCache.load(Path(__file__).resolve().parents[1] / "samples" / "code.safetensors")
    reps = -(-args.tokens // sample.num_tokens)
    tile = lambda arrays: [np.concatenate([a] * reps, axis=1)[:, : args.tokens] for a in arrays]  # noqa: E731
    cache = KVCache(tile(sample.keys), tile(sample.values), sample.model, {}, layer_ids=sample.layer_ids)
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipe or RECIPES:
            path = str(Path(tmp) / "c.kvz")
            kvtool.save(cache, path, recipe=recipe, threads=1)
            reader = kvtool.open_kvz(path)
            targets, rows, target_of = paged(reader)
            out = {"recipe": recipe}
            for op, run in (("load", lambda: kvtool.load(path, threads=1)),
                            ("read_rows", lambda: reader.read_rows(targets, rows, target_of))):
                cpu = []
                for _ in range(args.repeat):
                    started = time.process_time()
                    run()
                    cpu.append(time.process_time() - started)
                out[f"{op}_cpu_s_per_gb"] = round(min(cpu) / cache.nbytes * 1e9, 3)
                peak = subprocess.run([sys.executable, __file__, "--child", path, op], capture_output=True, text=True, check=True)
                out[f"{op}_peak_over_decoded"] = round(json.loads(peak.stdout)["peak_over_decoded"], 2)
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
