"""Several processes on one file store at once: throughput, latency, failures and wrong values.

    python benchmarks/store_shared_bench.py                      # 1, 2 and 4 processes x 500 operations
    python benchmarks/store_shared_bench.py --processes 4 --ops 2000 --capacity 4MiB --json

The workload is ``kvtool.testing.shared`` (the one ``SharedStoreTests`` runs):
each process opens the store and runs mixed puts (40%), gets (35%), contains,
info, deletes and key listings on 40 shared keys, values of 1 byte to 48 KiB
that each reader checks. The capacity is below what the keys need, so writers
evict each other's entries. Every put is fsynced: the numbers are the disk's as
much as kvtool's.
"""

from __future__ import annotations

import argparse
import json
import tempfile

from kvtool.store.file import FileStore
from kvtool.testing.shared import run_processes, summary
from kvtool.units import parse_size


def measure(processes: int, ops: int, capacity: int) -> dict:
    with tempfile.TemporaryDirectory() as root:
        reports = run_processes(f"file://{root}?capacity={capacity}", processes, ops)
        result = summary(reports)
        with FileStore(root) as store:
            result["used_bytes"] = store.used_bytes
            result["max_used_bytes"] = max(r["max_used_bytes"] for r in reports)
    result["capacity"] = capacity
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ops", type=int, default=500, help="operations per process")
    parser.add_argument("--capacity", type=parse_size, default=parse_size("512KiB"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    measure(1, 100, args.capacity)  # warm-up, not reported: the first run of a session measured slower
    results = [measure(n, args.ops, args.capacity) for n in args.processes]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print("| processes | ops | failures | wrong | ops/s | put p50 / p99 ms | get p50 / p99 ms | max used / capacity |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        put, get = r["ms"]["put"], r["ms"]["get"]
        print(f"| {r['processes']} | {r['ops']} | {r['failures']} | {r['wrong']} | {r['ops_per_s']} "
              f"| {put['p50']:.2f} / {put['p99']:.1f} | {get['p50']:.2f} / {get['p99']:.1f} "
              f"| {r['max_used_bytes']} / {r['capacity']} |")


if __name__ == "__main__":
    main()
