"""Several clients sharing one store: single Redis vs a 3-master Redis Cluster vs a shared file tier.

    python benchmarks/cluster_bench.py                      # starts its own servers on loopback
    python benchmarks/cluster_bench.py --clients 1 4 16 --ops 64 --json

Every client is a process of its own with its own store client, as each vLLM
server would be. The entry is one 256-token chunk of a real SmolLM2-135M KV
cache (samples/code.safetensors, 5.9 MB raw), encoded with the default recipe
as the vLLM connector stores it. Per backend and client count, ``--ops``
entries in all are put (each client its share, distinct keys), then read back
by ``get_entry`` (read and checksum verification), each client reading the
entries another client wrote. Throughput is stored bytes over the wall time
from the moment all clients start to the moment the last one ends; latencies
are over every call. All servers run on this machine: the single Redis and
the cluster's 3 masters and 3 replicas (which copy every write) share its
cores with the clients.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing as mp
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from kvtool.cache import KVCache
from kvtool.kvz import encode_cache
from kvtool.errors import UsageError
from kvtool.recipe import DEFAULT_RECIPE
from kvtool.store import open_store

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "code.safetensors"


def client(open_client, me: int, clients: int, per_client: int, blob: bytes, barrier, results) -> None:
    """Put this client's entries, wait for everyone, then read the entries of the next client."""
    try:
        with open_client() as store:
            store.contains("warm-up")  # connect (and learn the slot map) before the clock starts
            barrier.wait()
            puts = [_timed(lambda: store.put(f"c{me}-{i}", blob)) for i in range(per_client)]
            barrier.wait()
            other = (me + 1) % clients
            gets = [_timed(lambda: store.get_entry(f"c{other}-{i}")) for i in range(per_client)]
            barrier.wait()
        results.put((puts, gets))
    except BaseException:
        barrier.abort()  # the others stop waiting for this client
        raise


def _timed(call) -> float:
    start = time.perf_counter()
    if not call():
        raise SystemExit("a put or get failed (see the log)")
    return time.perf_counter() - start


def measure(url: str, clients: int, total_ops: int, blob: bytes) -> dict:
    per_client = max(1, total_ops // clients)
    if _one_process_at_a_time(url):
        # Threads of one process share one store (the file tier at this version takes one process at a time).
        shared = open_store(url)
        barrier, results = threading.Barrier(clients + 1, timeout=600), queue.Queue()
        workers = [threading.Thread(target=client, args=(lambda: contextlib.nullcontext(shared), c, clients,
                                                          per_client, blob, barrier, results)) for c in range(clients)]
    else:
        ctx = mp.get_context("fork")
        shared = None
        barrier, results = ctx.Barrier(clients + 1, timeout=600), ctx.Queue()
        workers = [ctx.Process(target=client, args=(functools.partial(open_store, url), c, clients, per_client,
                                                     blob, barrier, results)) for c in range(clients)]
    for worker in workers:
        worker.start()
    barrier.wait()  # all connected
    start = time.perf_counter()
    barrier.wait()  # all puts done
    put_wall = time.perf_counter() - start
    start = time.perf_counter()
    barrier.wait()  # all gets done
    get_wall = time.perf_counter() - start
    timings = [results.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join()
    if shared is not None:
        shared.close()
    puts = [t for put, _ in timings for t in put]
    gets = [t for _, get in timings for t in get]
    moved = len(blob) * clients * per_client
    with open_store(url) as store:  # leave the next run an empty store
        for key in store.keys():
            store.delete(key)
    return {
        "clients": clients,
        "each_a": "thread" if shared is not None else "process",
        "entries": clients * per_client,
        "put_GBps": round(moved / put_wall / 1e9, 3),
        "put_p50_ms": _ms(puts, 50),
        "put_p99_ms": _ms(puts, 99),
        "get_GBps": round(moved / get_wall / 1e9, 3),
        "get_p50_ms": _ms(gets, 50),
        "get_p99_ms": _ms(gets, 99),
    }


def _one_process_at_a_time(url: str) -> bool:
    """Whether a second process cannot open this store while one has it open."""
    with open_store(url):
        probe = mp.get_context("fork").Process(target=_open_and_close, args=(url,))
        probe.start()
        probe.join()
    return probe.exitcode != 0


def _open_and_close(url: str) -> None:
    try:
        open_store(url).close()
    except UsageError:
        sys.exit(1)


def _ms(seconds: list[float], q: int) -> float:
    return round(1000 * float(np.percentile(seconds, q)), 1)


def start_redis(workdir: Path) -> tuple[str, subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
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
    raise SystemExit("redis-server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16], help="concurrent clients (default: 1 4 16)")
    parser.add_argument("--ops", type=int, default=64, help="entries put and read per run, shared by the clients (default: 64)")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"recipe of the entry (default: {DEFAULT_RECIPE})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the servers on the way out
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed (Debian: apt-get install redis-server)")

    cache = KVCache.load(SAMPLE)
    blob = encode_cache(cache, args.recipe)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtool-cluster-bench-") as scratch:
        work = Path(scratch)
        redis_url, redis_proc = start_redis(work)
        cluster_dir = work / "cluster"
        script = ROOT / "scripts" / "redis-cluster.sh"
        cluster_url = subprocess.run(["bash", str(script), "start", str(cluster_dir), "auto"],
                                     check=True, capture_output=True, text=True).stdout.split()[-1]
        backends = {
            "redis (1 server)": f"{redis_url}?timeout=30&prefix=bench:",
            "redis+cluster (3 masters)": f"{cluster_url}?timeout=30&prefix=bench:",
            "file (shared directory)": f"file://{work / 'files'}",
        }
        try:
            for name, url in backends.items():
                for clients in args.clients:
                    rows.append({"store": name, **measure(url, clients, args.ops, blob)})
        finally:
            subprocess.run(["bash", str(script), "stop", str(cluster_dir)], check=True)
            redis_proc.terminate()
            redis_proc.wait()

    header = {"entry_MB": round(len(blob) / 1e6, 2), "raw_MB": round(cache.nbytes / 1e6, 2), "recipe": args.recipe}
    if args.json:
        print(json.dumps({**header, "rows": rows}, indent=2))
        return
    print(f"entry: {header['entry_MB']} MB stored ({header['raw_MB']} MB raw, 256 tokens, recipe {args.recipe})")
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(columns, widths)))


if __name__ == "__main__":
    main()
