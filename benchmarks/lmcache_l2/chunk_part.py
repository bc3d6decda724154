"""The chunk part: each LMCache L2 adapter alone, in this process, as LMCache's server drives it; and the decoder alone.

Real SmolLM2 chunks (samples/, laid out as LMCache lays out a chunk: ``[2, layers, 256
tokens, heads x head_dim]``, 5.9 MB each) are stored in one task and loaded back in one
task into fresh memory objects (the page cache of the adapter's files dropped first in
the cold cell), through LMCache's own config parser, factory and event fds, and compared
bit for bit. Each row: process CPU and wall seconds per GB of KV and per chunk, with the
adapter's own workers (kvtool's default 2; ``fs`` its asyncio loop), and the bytes held.

The decoder rows restore the same chunks, coded as the adapter codes them, from a memory
store in this thread (``kvtool.entries.restore_into``, the seam every integration
restores through): container parsing, checksums and the codec with nothing read from a
disk or a network, what a load costs beyond its read.
"""

from __future__ import annotations

import json
import select
import sys
import time
from pathlib import Path
from typing import Any, Callable

from cells import ADAPTERS, Place
from pagecache import drop, files, resident_bytes

ROOT = Path(__file__).resolve().parents[2]


def sample_chunks(count: int) -> list[Any]:
    sys.path.insert(0, str(ROOT / "tests" / "lmcache_e2e"))
    from chunk_objects import kv_chunk, memory_obj

    sources = [kv_chunk("code.safetensors"), kv_chunk("prose.safetensors")]
    return [memory_obj(sources[i % 2].clone()) for i in range(count)]


def _wait_store(adapter: Any, task: Any) -> bool:
    done: dict = {}
    while task not in done:
        select.select([adapter.get_store_event_fd()], [], [], 0.01)
        done.update(adapter.pop_completed_store_tasks())
    return bool(done[task].is_successful())


def _wait_load(adapter: Any, task: Any) -> Any:
    while (bitmap := adapter.query_load_result(task)) is None:
        select.select([adapter.get_load_event_fd()], [], [], 0.01)
    return bitmap


def adapters(names: tuple[str, ...], repeats: int, count: int, cold: bool, place_of: Callable[[str], Place],
             label: str = "") -> list[dict[str, Any]]:
    import torch
    from lmcache.v1.distributed.api import ObjectKey

    from timed_adapter import build_inner

    sys.path.insert(0, str(ROOT / "tests" / "lmcache_e2e"))
    from chunk_objects import empty_like

    chunks = sample_chunks(count)
    raw = sum(c.get_size() for c in chunks)
    rows = []
    for repeat in range(repeats):  # the configurations alternate, so that the machine's load swings hit all
        for name in names:
            place = place_of(f"chunks-{name}{label}-{repeat}")
            adapter = build_inner(ADAPTERS[name](place))
            keys = [ObjectKey(chunk_hash=(repeat << 32 | i).to_bytes(16, "big"), model_name="m", kv_rank=0)
                    for i in range(count)]
            try:
                cpu, wall = time.process_time(), time.perf_counter()
                stored = _wait_store(adapter, adapter.submit_store_task(keys, chunks))
                store_cpu, store_wall = time.process_time() - cpu, time.perf_counter() - wall
                held = sum(p.stat().st_size for p in files(place.folder)) if place.folder else _stored_bytes(adapter)
                resident = None
                if cold and place.folder is not None:
                    drop(place.folder)
                    resident = resident_bytes(place.folder)
                outs = [empty_like(c) for c in chunks]
                cpu, wall = time.process_time(), time.perf_counter()
                bitmap = _wait_load(adapter, adapter.submit_load_task(keys, outs))
                load_cpu, load_wall = time.process_time() - cpu, time.perf_counter() - wall
                exact = stored and len(bitmap.get_indices_list()) == count and all(
                    torch.equal(o.raw_data, c.raw_data) for o, c in zip(outs, chunks))
                workers = adapter.report_status().get("workers")
            finally:
                adapter.close()
            rows.append(timing_row("chunks", name + label, repeat, count, raw, held, (store_cpu, store_wall),
                                   (load_cpu, load_wall), resident_at_load=resident, workers=workers,
                                   bit_exact=bool(exact)))
            print(f"chunks {name}{label} #{repeat}: {json.dumps(rows[-1])}", flush=True)
    return rows


def timing_row(part: str, config: str, repeat: int, count: int, raw: int, held: int, store: tuple[float, float],
               load: tuple[float, float], **extra: Any) -> dict[str, Any]:
    """One measured store and load of ``count`` chunks (``raw`` bytes of KV): (CPU, wall) seconds of each,
    per GB of KV and per chunk."""
    gb = raw / 1e9
    (store_cpu, store_wall), (load_cpu, load_wall) = store, load
    return {"part": part, "config": config, "repeat": repeat, "chunks": count, "raw_bytes": raw, "held_bytes": held,
            "store_cpu_s_per_gb": store_cpu / gb, "store_wall_s_per_gb": store_wall / gb,
            "load_cpu_s_per_gb": load_cpu / gb, "load_wall_s_per_gb": load_wall / gb,
            "store_wall_s_per_chunk": store_wall / count, "load_wall_s_per_chunk": load_wall / count,
            "load_cpu_s_per_chunk": load_cpu / count, **extra}


def _stored_bytes(adapter: Any) -> int:
    """A kvtool adapter's bytes written, from its counters (a Redis store has no folder to measure)."""
    counters = adapter.report_status().get("counters") or {}
    return int(counters.get("stored_bytes", 0))


def decoder(recipes: tuple[str, ...], repeats: int, count: int) -> list[dict[str, Any]]:
    """The same chunks, coded as the adapter codes them into a memory store, restored into a destination in this
    thread through the seam every integration restores through: nothing read from a disk or a network."""
    import numpy as np

    from kvtool.entries import put_cache, restore_into
    from kvtool.integrations.lmcache.adapter import layout_of
    from kvtool.store import open_store

    chunks = sample_chunks(count)
    raw = sum(c.get_size() for c in chunks)
    layouts = [layout_of(c) for c in chunks]
    store = open_store("memory://")
    held = {recipe: sum(put_cache(store, f"{recipe}/{i}", lay.cache(np.frombuffer(c.byte_array, np.uint8), "m"),
                                  recipe).stored_bytes for i, (c, lay) in enumerate(zip(chunks, layouts)))
            for recipe in recipes}
    out = np.empty(chunks[0].get_size(), np.uint8)
    gb = raw / 1e9
    rows = []
    for repeat in range(repeats):
        for recipe in recipes:
            cpu, wall = time.thread_time(), time.perf_counter()
            restored = [restore_into(store, f"{recipe}/{i}", lay.expected(), lay.destination(out)).ok
                        for i, lay in enumerate(layouts)]
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            exact = all(restored) and bool(np.array_equal(out, np.frombuffer(chunks[-1].byte_array, np.uint8)))
            rows.append({"part": "decoder", "config": f"decode {recipe}", "repeat": repeat, "chunks": count,
                         "raw_bytes": raw, "held_bytes": held[recipe], "workers": 1,
                         "load_cpu_s_per_gb": cpu / gb, "load_wall_s_per_gb": wall / gb,
                         "load_wall_s_per_chunk": wall / count, "load_cpu_s_per_chunk": cpu / count,
                         "bit_exact": exact})
            print(f"decoder {recipe} #{repeat}: {json.dumps(rows[-1])}", flush=True)
    store.close()
    return rows
