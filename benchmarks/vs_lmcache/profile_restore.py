"""Where kvtool's restore (and save) time goes, outside vLLM, on a real KV cache, phase by phase.

    python benchmarks/vs_lmcache/profile_restore.py [--entries 8] [--block-size 128] [--repeat 5]

Run it with a python that has torch (kvtool's vLLM environment). It builds paged KV
tensors in vLLM 0.32's CPU layout (``[blocks, kv_heads, block_size, 2 * head_dim]``, one
per layer), stores ``--entries`` 256-token entries of a real SmolLM2 cache
(samples/code.safetensors) in a memory store with each recipe, and then times the
connector's own functions (``kvtool.integrations.vllm.transfer``) one phase at a time:
fetch + unwrap (``get_entry``), ``KvzReader.from_bytes``, per-layer ``read`` (decode),
``from_numpy`` and ``scatter_blocks`` (a decode into a buffer, then a copy into paged blocks: the
path the connector took before it decoded into the blocks); ``Restore`` as the connector runs
it on a CPU cache (each entry decoded straight into its blocks), end to end, and as it runs
with overlap (layer by layer on a thread, each layer straight into its blocks); and on the save
side ``gather_blocks`` and ``encode_and_store``. Beside them, two ways of doing the copy that the connector does
not use yet, on the same data, checked to give the same bytes: one strided ``copy_`` per
run of consecutive blocks, and a plain contiguous memcpy of the same bytes (what a raw
shared-memory tier like LMCache's pays at least); and a capture that joins the blocks'
views with one ``torch.cat`` instead of ``gather_blocks``. Times are the best of ``--repeat``
(wall clock, one thread), in ms per restored entry and MB/s of raw KV.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from kvtool.cache import KVCache  # noqa: E402
from kvtool.kvz import KvzReader  # noqa: E402
from kvtool.integrations.vllm.paged import from_numpy, gather_blocks, kv_views, scatter_blocks, to_numpy  # noqa: E402
from kvtool.integrations.vllm.plan import LoadJob  # noqa: E402
from kvtool.integrations.vllm.transfer import PagedLayers, Restore, encode_and_store  # noqa: E402
from kvtool.store.memory import MemoryStore  # noqa: E402

TOKENS = 256


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def best_interleaved(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    """The best time of each function, run in turns, so that a busy spell slows them alike."""
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, t in zip(fns, times):
            start = time.perf_counter()
            fn()
            t.append(time.perf_counter() - start)
    return [min(t) for t in times]


def scatter_runs(view: torch.Tensor, block_ids: list[int], array: torch.Tensor) -> None:
    """A proposed copy: one strided ``copy_`` per run of consecutive block ids, no index tensor, no temporary."""
    heads, _, dim = array.shape
    src = array.view(heads, len(block_ids), view.shape[2], dim).permute(1, 0, 2, 3)
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            view[block_ids[start]: block_ids[i - 1] + 1].copy_(src[start:i])
            start = i


def gather_views(view: torch.Tensor, block_ids: list[int]):
    """A proposed capture: the blocks' ``[heads, block, dim]`` views joined along the token axis, one copy."""
    return to_numpy(torch.cat([view[b] for b in block_ids], dim=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--entries", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128, help="vLLM's block size (the CPU backend's default is 128)")
    p.add_argument("--recipes", default="exphuff,none")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)

    cache = KVCache.load(ROOT / "samples" / "code.safetensors")
    layers, (heads, _, dim) = len(cache.keys), cache.keys[0].shape
    bs, per_entry = args.block_size, TOKENS // args.block_size
    num_blocks = args.entries * per_entry + 8
    paged = [torch.zeros(num_blocks, heads, bs, 2 * dim, dtype=torch.bfloat16) for _ in range(layers)]
    views = [kv_views(t, "CPU_ATTN", dim, bs) for t in paged]
    names = [f"layer.{i}" for i in range(layers)]
    paged_layers = PagedLayers(names, [k for k, _ in views], [v for _, v in views], bs, torch.bfloat16)
    raw_entry = cache.nbytes
    mb = raw_entry / 1e6
    block_ids = [list(range(1 + e * per_entry, 1 + (e + 1) * per_entry)) for e in range(args.entries)]

    rows = []
    for recipe in args.recipes.split(","):
        store = MemoryStore(capacity=None)
        keys = [f"entry-{e}" for e in range(args.entries)]
        save_s = best(lambda: [encode_and_store(store, k, cache.keys, cache.values, recipe, cache.model) for k in keys],
                      args.repeat)
        stored = store.stats()["used_bytes"] / args.entries
        gather_s = best(lambda: [gather_blocks(paged_layers.keys[i], ids) for ids in block_ids for i in range(layers)
                                 for _ in (0, 1)], args.repeat)
        gather_views_s = best(lambda: [gather_views(paged_layers.keys[i], ids) for ids in block_ids
                                       for i in range(layers) for _ in (0, 1)], args.repeat)
        same_capture = all((gather_blocks(paged_layers.keys[i], ids).view("u2") == gather_views(paged_layers.keys[i], ids).view("u2")).all()
                           for ids in block_ids for i in range(layers))

        get_s = best(lambda: [store.get_entry(k) for k in keys], args.repeat)
        fetch_s = best(lambda: [store._read(k) for k in keys], args.repeat)
        blobs = [store.get_entry(k).value for k in keys]
        open_s = best(lambda: [KvzReader.from_bytes(b) for b in blobs], args.repeat)
        readers = [KvzReader.from_bytes(b) for b in blobs]
        decode_s = best(lambda: [r.read(layers=[i], tokens=slice(0, TOKENS), threads=1) for r in readers
                                 for i in range(layers)], args.repeat)
        decoded = [[r.read(layers=[i], tokens=slice(0, TOKENS), threads=1) for i in range(layers)] for r in readers]
        tensors = [[(from_numpy(c.keys[0], torch.bfloat16), from_numpy(c.values[0], torch.bfloat16)) for c in d]
                   for d in decoded]
        to_torch_s = best(lambda: [(from_numpy(c.keys[0], torch.bfloat16), from_numpy(c.values[0], torch.bfloat16))
                                   for d in decoded for c in d], args.repeat)

        def copy_with(fn: Callable) -> Callable[[], None]:
            def run() -> None:
                for e, ids in enumerate(block_ids):
                    for i in range(layers):
                        k, v = tensors[e][i]
                        fn(paged_layers.keys[i], ids, k)
                        fn(paged_layers.values[i], ids, v)
            return run

        copy_s = best(copy_with(scatter_blocks), args.repeat)
        expected = [t.clone() for t in paged]
        for t in paged:
            t.zero_()
        per_block_s = best(copy_with(scatter_runs), args.repeat)
        same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(paged, expected))
        flat = [torch.empty(heads * TOKENS * dim * 2, dtype=torch.bfloat16) for _ in range(layers)]
        memcpy_s = best(lambda: [flat[i].copy_(torch.cat([tensors[e][i][0].reshape(-1), tensors[e][i][1].reshape(-1)]))
                                 for e in range(args.entries) for i in range(layers)], args.repeat)

        jobs = {"r": [LoadJob(k, per_entry, 0, ids) for k, ids in zip(keys, block_ids)]}

        def restore(background: bool) -> None:
            r = Restore(store, lambda key: key, paged_layers, jobs)
            r.start(background=background)
            for i in range(layers):
                r.copy_layer(i)
            if r.finish():
                raise RuntimeError("restore failed")

        for t in paged:
            t.zero_()
        restore(False)
        same = same and all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(paged, expected))
        restore_s, layered_s = best_interleaved([lambda: restore(False), lambda: restore(True)], args.repeat)
        n = args.entries
        row = {
            "recipe": recipe, "raw_bytes_per_entry": raw_entry, "stored_bytes_per_entry": round(stored),
            "ratio": round(raw_entry / stored, 4), "same_bytes_proposed": bool(same and same_capture),
            "ms_per_entry": {
                "restore (Restore, end to end)": restore_s / n * 1e3,
                "restore, layer by layer (overlap path)": layered_s / n * 1e3,
                "fetch (store read)": fetch_s / n * 1e3,
                "unwrap (get_entry - fetch)": max(0.0, get_s - fetch_s) / n * 1e3,
                "open (KvzReader.from_bytes)": open_s / n * 1e3,
                "decode (read, every layer)": decode_s / n * 1e3,
                "to_torch (from_numpy)": to_torch_s / n * 1e3,
                "copy (scatter_blocks)": copy_s / n * 1e3,
                "copy, proposed (copy_ per block run)": per_block_s / n * 1e3,
                "copy, memcpy of the same bytes": memcpy_s / n * 1e3,
                "save: gather_blocks": gather_s / n * 1e3,
                "save: gather, proposed (cat of views)": gather_views_s / n * 1e3,
                "save: encode_and_store": save_s / n * 1e3,
            },
        }
        row["MB/s"] = {k: round(mb / (v / 1e3)) if v > 0 else None for k, v in row["ms_per_entry"].items()}
        row["ms_per_entry"] = {k: round(v, 3) for k, v in row["ms_per_entry"].items()}
        rows.append(row)
    result = {"entries": args.entries, "tokens_per_entry": TOKENS, "block_size": bs, "layers": layers,
              "kv_heads": heads, "head_dim": dim, "torch_threads": torch.get_num_threads(), "recipes": rows}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{args.entries} entries of {TOKENS} tokens ({raw_entry / 1e6:.2f} MB raw each), block size {bs}, best of {args.repeat}")
    print(f"{'phase':40s}" + "".join(f"{r['recipe'] + ' ms':>14s}{'MB/s':>8s}" for r in rows))
    for phase in rows[0]["ms_per_entry"]:
        print(f"{phase:40s}" + "".join(f"{r['ms_per_entry'][phase]:14.3f}{r['MB/s'][phase] or 0:8d}" for r in rows))
    for r in rows:
        print(f"{r['recipe']}: {r['stored_bytes_per_entry']} bytes stored per entry (ratio {r['ratio']}); "
              f"the direct restore and the proposed copy and capture give the same bytes as the layer-by-layer path: "
              f"{r['same_bytes_proposed']}")


if __name__ == "__main__":
    main()
