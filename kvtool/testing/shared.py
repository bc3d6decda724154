"""Several processes working on one store at once, each checking every value it reads.

``run_processes(url, processes, ops)`` starts ``processes`` interpreters that
each open the store at ``url`` and run ``ops`` mixed operations (put, get,
contains, info, delete, keys) on a small shared key set, so they overwrite,
delete and evict each other's entries. Every value says which key it belongs
to and carries a checksum of itself, so a reader knows a wrong or partial value
from a right one whoever wrote it. Each process reports JSON: operations,
failures (a put refused, an exception), wrong values, the highest
``used_bytes`` it saw, its time and per-operation latencies. ``SharedStoreTests`` and
``benchmarks/store_shared_bench.py`` run the same workload.

    python -m kvtool.testing.shared URL WORKER OPS SEED   # one process; prints its JSON report
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
import time
from typing import Any

from kvtool.store import open_store

KEYS = [f"shared/{i}" for i in range(40)]
# Operation mix: puts and gets dominate, as in a cache; deletes make room for surprises.
MIX = (("put", 40), ("get", 35), ("contains", 8), ("info", 7), ("delete", 7), ("keys", 3))
MAX_VALUE = 48 * 1024


def value_for(key: str, worker: int, seq: int, size: int) -> bytes:
    """A value of ``size`` bytes or more that names its key and proves its own integrity."""
    header = f"{key}|{worker}|{seq}|{size}|".encode()
    body = hashlib.blake2b(header, digest_size=32).digest() * (size // 32 + 1)
    return header + body[:size]


def is_valid(key: str, value: bytes) -> bool:
    """True if ``value`` is a whole value that ``value_for`` made for ``key``."""
    try:
        name, worker, seq, size, _ = value.split(b"|", 4)
        return value == value_for(name.decode(), int(worker), int(seq), int(size)) and name.decode() == key
    except ValueError:
        return False


def run_mixed_ops(url: str, worker: int, ops: int, seed: int) -> dict[str, Any]:
    """Run ``ops`` random operations on the store at ``url``; the report ``run_processes`` collects."""
    rng = random.Random(seed * 1000 + worker)
    names = [name for name, _ in MIX]
    weights = [weight for _, weight in MIX]
    latencies: dict[str, list[float]] = {name: [] for name in names}
    failures: list[str] = []
    wrong = 0
    max_used = 0
    with open_store(url) as store:
        began = time.perf_counter()
        for seq in range(ops):
            op = rng.choices(names, weights)[0]
            key = rng.choice(KEYS)
            start = time.perf_counter()
            try:
                if op == "put":
                    if not store.put(key, value_for(key, worker, seq, rng.randrange(1, MAX_VALUE))):
                        failures.append(f"put {key} refused")
                elif op == "get":
                    got = store.get(key)
                    wrong += got is not None and not is_valid(key, got)
                elif op == "contains":
                    store.contains(key)
                elif op == "info":
                    info = store.info(key)
                    wrong += info is not None and info.key != key
                elif op == "delete":
                    store.delete(key)
                else:
                    wrong += not set(store.keys()) <= set(KEYS)
            except Exception as exc:  # noqa: BLE001 - reported, not raised: the parent counts failures
                failures.append(f"{op} {key}: {type(exc).__name__}: {exc}")
            latencies[op].append(time.perf_counter() - start)
            max_used = max(max_used, store.used_bytes or 0)
        seconds = time.perf_counter() - began
    return {
        "worker": worker,
        "ops": ops,
        "failures": failures[:20],
        "failure_count": len(failures),
        "wrong": wrong,
        "max_used_bytes": max_used,
        "seconds": seconds,
        "latencies": latencies,
    }


def run_processes(url: str, processes: int, ops: int, seed: int = 0, timeout: float = 600) -> list[dict[str, Any]]:
    """Start ``processes`` workers on ``url`` at once and collect their reports (a crashed worker raises)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "kvtool.testing.shared", url, str(worker), str(ops), str(seed)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for worker in range(processes)
    ]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"worker exited with {proc.returncode}: {err[-2000:]}")
        reports.append(json.loads(out))
    return reports


def summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over the workers' reports, and p50/p99 latency per operation in milliseconds.

    ``ops_per_s``: all operations over the longest worker's time running them
    (interpreter start and store opening not included).
    """
    merged: dict[str, list[float]] = {}
    for report in reports:
        for op, values in report["latencies"].items():
            merged.setdefault(op, []).extend(values)
    return {
        "processes": len(reports),
        "ops": sum(r["ops"] for r in reports),
        "failures": sum(r["failure_count"] for r in reports),
        "wrong": sum(r["wrong"] for r in reports),
        "ops_per_s": round(sum(r["ops"] for r in reports) / max(r["seconds"] for r in reports)),
        "ms": {op: {"p50": _ms(v, 0.5), "p99": _ms(v, 0.99)} for op, v in merged.items() if v},
    }


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)


if __name__ == "__main__":
    url, worker, ops, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(run_mixed_ops(url, worker, ops, seed)))
