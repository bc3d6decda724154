"""Put throughput and restore (get) latency of each store tier for one agent-sized KV cache.

    python benchmarks/store_bench.py                      # memory, file, and redis if redis-server is installed
    python benchmarks/store_bench.py --redis redis://host:6379/0 --repeat 20 --json

The payload is the size of a 4096-token SmolLM2-135M cache: 23,040 bytes per
token in bf16 (94 MB raw), and 0.68x of that as a compressed recipe would
store it. Payload bytes are random: a store does not look inside its values.
A restore is ``get_entry``: read, checksum verification, and a view of the
value (what ``kvtool.container.decode_cache`` takes); ``get`` adds one copy
into a new ``bytes``. File-tier reads come from the page cache after the first one,
as they would for a cache entry that is reused soon.
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

from kvtool.store import Store, open_store

TOKENS = 4096
BYTES_PER_TOKEN = 23_040  # SmolLM2-135M, bf16: 30 layers x (K + V) x 3 heads x 64 dims x 2 bytes
COMPRESSED_RATIO = 0.68


def measure(store: Store, payload: bytes, repeat: int) -> dict:
    """Put throughput, restore latency (``get_entry``: verified, a view of the value) and ``get`` latency."""
    puts, restores, gets = [], [], []
    for i in range(repeat):
        key = f"bench-{i % 2}"
        puts.append(_timed(lambda: store.put(key, payload, {"tokens": TOKENS})))
        restores.append(_timed(lambda: store.get_entry(key)))
        gets.append(_timed(lambda: store.get(key)))
    mb = len(payload) / 1e6
    return {
        "payload_MB": round(mb, 1),
        "put_MBps": round(mb / statistics.median(puts)),
        "restore_MBps": round(mb / statistics.median(restores)),
        "restore_p50_ms": _ms(restores, 50),
        "restore_p99_ms": _ms(restores, 99),
        "get_bytes_p50_ms": _ms(gets, 50),
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
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--repeat", type=int, default=10, help="puts and gets per tier and size (default: 10)")
    parser.add_argument("--dir", type=Path, help="directory for the file tier (default: a temporary one)")
    parser.add_argument("--redis", help="redis URL; default: start a local redis-server if one is installed")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()

    raw = args.tokens * BYTES_PER_TOKEN
    sizes = {"raw bf16": raw, f"compressed {COMPRESSED_RATIO}x": int(raw * COMPRESSED_RATIO)}
    payload = np.random.default_rng(0).integers(0, 256, raw, dtype=np.uint8).tobytes()

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
                for label, n in sizes.items():
                    rows.append({"tier": tier, "payload": label, **measure(store, payload[:n], args.repeat)})
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
