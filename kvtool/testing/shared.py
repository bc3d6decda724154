"""Several processes working on one store at once, each checking every value it reads.

``run_processes(url, processes, ops)`` starts ``processes`` interpreters that
each open the store at ``url`` and run ``ops`` mixed operations (put, get,
contains, info, delete, keys) on a small shared key set, so they overwrite,
delete and evict each other's entries. Every value says which key it belongs
to and carries a checksum of itself, so a reader knows a wrong or partial value
from a right one whoever wrote it. Each process reports JSON: operations,
failures (an exception), puts the store refused, wrong values, the highest
``used_bytes`` it saw, its time and per-operation latencies. ``SharedStoreTests`` and
``benchmarks/store_shared_bench.py`` run the same workload.

A worker reaches the store one of four ways (``KINDS``): ``library`` (``open_store`` in its
process), ``threads`` (``THREADS`` threads of one process on one store object), ``api``
(a ``kvtool serve`` of the same URL, through ``ApiClient``) and ``cli`` (``kvtool store
put/get/evict/ls`` commands, one process each). ``run_mix`` starts the server and a mix of
them at once; ``kvtool.testing.writers`` holds the api and cli ways.

    python -m kvtool.testing.shared URL WORKER OPS SEED [KIND [API_URL TOKEN_FILE]]   # prints its JSON report
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
import threading
import time
from typing import Any

from kvtool.store import open_store

KEYS = [f"shared/{i}" for i in range(40)]
# Operation mix: puts and gets dominate, as in a cache; deletes make room for surprises.
MIX = (("put", 40), ("get", 35), ("contains", 8), ("info", 7), ("delete", 7), ("keys", 3))
MAX_VALUE = 48 * 1024
KINDS = ("library", "threads", "api", "cli")
THREADS = 3


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


def run_mixed_ops(url: str, worker: int, ops: int, seed: int, kind: str = "library",
                  api: tuple[str, str] | None = None) -> dict[str, Any]:
    """Run ``ops`` random operations on the store at ``url`` the ``kind`` way; the report ``run_processes`` collects."""
    if kind == "threads":
        return _threads(url, worker, ops, seed)
    if kind == "library":
        with open_store(url) as store:
            return _run(store, worker, ops, seed)
    from kvtool.testing.writers import api_ops, cli_ops

    with (api_ops(*api) if kind == "api" and api else cli_ops(url)) as target:
        return _run(target, worker, ops, seed)


def _threads(url: str, worker: int, ops: int, seed: int) -> dict[str, Any]:
    """``THREADS`` library writers in one process, on one store object; their reports merged."""
    with open_store(url) as store:
        reports: list[dict[str, Any]] = []
        threads = [threading.Thread(target=lambda n=n: reports.append(_run(store, worker * 100 + n, ops, seed)))
                   for n in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    merged = {"worker": worker, "ops": ops * THREADS, "failures": [f for r in reports for f in r["failures"]][:20],
              "failure_count": sum(r["failure_count"] for r in reports), "wrong": sum(r["wrong"] for r in reports),
              "refused": sum(r["refused"] for r in reports),
              "max_used_bytes": max(r["max_used_bytes"] for r in reports),
              "seconds": max(r["seconds"] for r in reports), "latencies": {}}
    for report in reports:
        for op, values in report["latencies"].items():
            merged["latencies"].setdefault(op, []).extend(values)
    return merged


def _run(store: Any, worker: int, ops: int, seed: int) -> dict[str, Any]:
    """The operations on ``store`` (a Store, or an object with the same six calls and ``used_bytes``)."""
    rng = random.Random(seed * 1000 + worker)
    names = [name for name, _ in MIX]
    weights = [weight for _, weight in MIX]
    latencies: dict[str, list[float]] = {name: [] for name in names}
    failures: list[str] = []
    wrong = refused = 0
    max_used = 0
    began = time.perf_counter()
    for seq in range(ops):
        op = rng.choices(names, weights)[0]
        key = rng.choice(KEYS)
        start = time.perf_counter()
        try:
            if op == "put":
                if not store.put(key, value_for(key, worker, seq, rng.randrange(1, MAX_VALUE))):
                    refused += 1
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
    return {
        "worker": worker,
        "ops": ops,
        "failures": failures[:20],
        "failure_count": len(failures),
        "refused": refused,
        "wrong": wrong,
        "max_used_bytes": max_used,
        "seconds": time.perf_counter() - began,
        "latencies": latencies,
    }


def run_processes(url: str, processes: int, ops: int, seed: int = 0, timeout: float = 600) -> list[dict[str, Any]]:
    """Start ``processes`` library workers on ``url`` at once and collect their reports (a crashed worker raises)."""
    return _collect([_start(url, worker, "library", ops, seed) for worker in range(processes)], timeout)


def run_mix(url: str, mix: dict[str, int], ops: dict[str, int], seed: int = 0,
            timeout: float = 600) -> list[dict[str, Any]]:
    """``mix[kind]`` workers of each kind at once on ``url``, each running ``ops[kind]`` operations,
    with a ``kvtool serve`` of ``url`` for the ``api`` ones; their reports, ``kind`` added."""
    from kvtool.testing.writers import serving

    kinds = [kind for kind, count in mix.items() for _ in range(count)]
    with serving(url) as api:
        return _collect([_start(url, worker, kind, ops[kind], seed, api) for worker, kind in enumerate(kinds)],
                        timeout)


def _start(url: str, worker: int, kind: str, ops: int, seed: int,
           api: tuple[str, str] | None = None) -> tuple[str, subprocess.Popen]:
    command = [sys.executable, "-m", "kvtool.testing.shared", url, str(worker), str(ops), str(seed), kind]
    if kind == "api" and api:
        command += list(api)
    return kind, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _collect(procs: list[tuple[str, subprocess.Popen]], timeout: float) -> list[dict[str, Any]]:
    reports = []
    for kind, proc in procs:
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"a {kind} worker exited with {proc.returncode}: {err[-2000:]}")
        reports.append({**json.loads(out), "kind": kind})
    return reports


def check_shared(url: str, reports: list[dict[str, Any]], refusals: float = 0.0) -> None:
    """No failed operation (a miss is none), no wrong value, every entry whole, the capacity held;
    at most ``refusals`` of the operations a put the store refused (none by default)."""
    assert [f for r in reports for f in r["failures"]] == []
    assert sum(r["failure_count"] for r in reports) == 0
    refused, ops = sum(r["refused"] for r in reports), sum(r["ops"] for r in reports)
    assert refused <= refusals * ops, f"{refused} of {ops} operations were refused puts"
    assert sum(r["wrong"] for r in reports) == 0
    with open_store(url, read_only=True) as store:
        assert set(store.keys()) <= set(KEYS)
        for key in store.keys():
            value = store.get(key)
            assert value is not None and is_valid(key, value)
        if store.capacity is not None:
            used = store.used_bytes
            assert used is not None and used <= store.capacity
            assert max(r["max_used_bytes"] for r in reports) <= store.capacity


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
        "failures": sum(r["failure_count"] + r["refused"] for r in reports),
        "wrong": sum(r["wrong"] for r in reports),
        "ops_per_s": round(sum(r["ops"] for r in reports) / max(r["seconds"] for r in reports)),
        "ms": {op: {"p50": _ms(v, 0.5), "p99": _ms(v, 0.99)} for op, v in merged.items() if v},
    }


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)


if __name__ == "__main__":
    url, worker, ops, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    kind = sys.argv[5] if len(sys.argv) > 5 else "library"
    print(json.dumps(run_mixed_ops(url, worker, ops, seed, kind, (sys.argv[6], sys.argv[7]) if kind == "api" else None)))
