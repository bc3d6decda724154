"""Put throughput and restore latency of each store tier for a real 4096-token KV cache.

    python benchmarks/store_bench.py out/code-4096.safetensors   # memory, file, and redis if installed
    python benchmarks/store_bench.py CACHE --redis redis://host:6379/0 --repeat 20 --json

The cache (a 4096-token SmolLM2-135M dump: 23,040 bytes per token in bf16,
94 MB; samples/README.md has the command) is stored as one .kvz entry with no
compression (``none``) and with the default recipe. ``put`` is the store call
alone; ``store get`` is ``get_entry`` (read, checksum verification, a view of
the value); ``restore`` adds decoding that view back into a KV cache, the whole
path from tier to tensors. File-tier reads come from the page cache after the
first one, as they would for a cache entry that is reused soon.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from kvtool.cache import KVCache
from kvtool.kvz import decode_cache, encode_cache
from kvtool.recipe import DEFAULT_RECIPE
from kvtool.store import Store, open_store


def measure(store: Store, blob: bytes, cache: KVCache, repeat: int) -> dict:
    """Put throughput, then p50/p99 of the store read alone and of the full restore to tensors."""
    puts, reads, restores = [], [], []
    for i in range(repeat):
        key = f"bench-{i % 2}"
        puts.append(_timed(lambda: store.put(key, blob, {"tokens": cache.num_tokens})))
        reads.append(_timed(lambda: store.get_entry(key)))
        restores.append(_timed(lambda: decode_cache(store.get_entry(key).value)))
    raw_mb = cache.nbytes / 1e6
    return {
        "stored_MB": round(len(blob) / 1e6, 1),
        "put_MBps": round(raw_mb / statistics.median(puts)),
        "get_p50_ms": _ms(reads, 50),
        "get_p99_ms": _ms(reads, 99),
        "restore_p50_ms": _ms(restores, 50),
        "restore_p99_ms": _ms(restores, 99),
        "restore_MBps": round(raw_mb / statistics.median(restores)),
    }


def _timed(call) -> float:
    start = time.perf_counter()
    result = call()
    if not result:
        raise SystemExit("a put or get failed (see the log)")
    return time.perf_counter() - start


def _ms(seconds: list[float], q: int) -> float:
    return round(1000 * float(np.percentile(seconds, q)), 1)


def start_redis() -> tuple[str, subprocess.Popen] | None:
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return f"redis://127.0.0.1:{port}/0", proc
        except OSError:
            time.sleep(0.05)
    proc.terminate()
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", type=Path, help="a KV cache (safetensors), e.g. out/code-4096.safetensors")
    parser.add_argument("--repeat", type=int, default=10, help="puts and gets per tier and size (default: 10)")
    parser.add_argument("--dir", type=Path, help="directory for the file tier (default: a temporary one)")
    parser.add_argument("--redis", help="redis URL; default: start a local redis-server if one is installed")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()

    cache = KVCache.load(args.cache)
    blobs = {recipe: encode_cache(cache, recipe) for recipe in ("none", DEFAULT_RECIPE)}

    redis_server = None
    redis_url = args.redis
    if redis_url is None:
        started = start_redis()
        if started is not None:
            redis_url, redis_server = started
    scratch = tempfile.TemporaryDirectory(prefix="kvtool-bench-")
    tiers = {"memory": "memory://?capacity=1GiB", "file": f"file://{args.dir or scratch.name}"}
    if redis_url:
        tiers["redis"] = f"{redis_url}?timeout=10&prefix=kvtool-bench:"

    rows = []
    try:
        for tier, url in tiers.items():
            with open_store(url) as store:
                for recipe, blob in blobs.items():
                    rows.append({"tier": tier, "recipe": recipe, **measure(store, blob, cache, args.repeat)})
                for key in ("bench-0", "bench-1"):
                    store.delete(key)
    finally:
        scratch.cleanup()
        if redis_server is not None:
            redis_server.terminate()

    if args.json:
        print(json.dumps(rows, indent=2))
        return
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(columns, widths)))


if __name__ == "__main__":
    main()
