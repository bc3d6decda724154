"""kvtool's Redis and Redis Cluster tiers under ``maxmemory``, with a working set three times the budget.

    python benchmarks/redis_maxmemory.py --budget-mib 8 --writers 4 --passes 2 --json   # starts its own servers

A throwaway redis-server (and, with ``--cluster``, a 3-master Redis Cluster:
scripts/redis-cluster.sh) gets ``maxmemory`` = what it uses now + the budget
(split over the masters), under each ``--policies`` (Redis's default
``noeviction``, and ``allkeys-lru``). ``--writers`` processes, each with a store
of its own, put entries (``--value-kib``, incompressible) whose total is
``--times`` the budget, ``--passes`` times over in a seeded random order, at
once. Each writer counts its puts and what they returned, and reads its store's
``stats()`` (``put_failures``, ``put_refused``, ``evictions``); the servers say
how many writes they refused for lack of memory (``errorstat_OOM``) and how many
keys they evicted.

``stored`` is the share of puts that stored; ``unreported`` the puts that
returned False without being counted in ``put_failures`` (must be 0). The last
line printed is one JSON object (``--json``) or a table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from torture_faults import Cluster, Redis

ROOT = Path(__file__).resolve().parents[1]


def writer(url: str, keys: list[str], value_bytes: int, seed: int, results) -> None:
    """Put every key (each its own incompressible value); report what the puts returned and the store counted."""
    from kvtool.store import open_store

    rng = random.Random(seed)
    tally = {"puts": 0, "stored": 0}
    with open_store(url) as store:
        for key in keys:
            tally["puts"] += 1
            tally["stored"] += store.put(key, rng.randbytes(value_bytes))
        stats = store.stats()
    results.put({**tally, **{k: stats[k] for k in ("put_failures", "put_refused", "evictions", "errors")}})


def limit(ports: list[int], budget: int, policy: str) -> None:
    """Each master: maxmemory = what it uses + its share of the budget, under ``policy``."""
    import redis

    for port in ports:
        with redis.Redis(port=port, socket_timeout=5) as client:
            client.config_set("repl-backlog-size", 16384)
            client.config_set("maxmemory-policy", policy)
            client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + budget // len(ports))


def masters(cluster: Cluster | None, single: Redis | None) -> list[int]:
    return cluster.masters() if cluster is not None else [single.port]  # type: ignore[union-attr]


def one_case(topology: str, policy: str, args: argparse.Namespace, work: Path) -> dict:
    work = work / f"{topology}-{policy}"
    work.mkdir()
    single = Redis(work) if topology == "redis" else None
    cluster = Cluster(work) if topology == "redis+cluster" else None
    try:
        server = cluster or single
        assert server is not None
        ports = masters(cluster, single)
        budget = args.budget_mib << 20
        limit(ports, budget, policy)
        value = args.value_kib << 10
        count = args.times * budget // value
        prefix = f"{topology}-{policy}"
        url = f"{server.url}?prefix=mm:&ttl=none&timeout=5"
        rng = random.Random(args.seed)
        names = [f"{prefix}-{i}" for i in range(count)]
        order = [name for _ in range(args.passes) for name in rng.sample(names, len(names))]
        shares = [order[w::args.writers] for w in range(args.writers)]
        results: multiprocessing.Queue = multiprocessing.Queue()
        started = time.monotonic()
        procs = [multiprocessing.Process(target=writer, args=(url, share, value, args.seed + w, results))
                 for w, share in enumerate(shares)]
        for proc in procs:
            proc.start()
        reports = [results.get(timeout=1800) for _ in procs]
        for proc in procs:
            proc.join()
        seconds = time.monotonic() - started
        from kvtool.store import open_store

        with open_store(url) as store:
            server_stats = {k: v for k, v in store.stats().items() if k.startswith("server_")}
        total = {k: sum(r[k] for r in reports) for k in reports[0]}
        failed = total["puts"] - total["stored"]
        return {"topology": topology, "policy": policy, "budget_bytes": budget, "working_set_bytes": count * value,
                "value_bytes": value, "writers": args.writers, **total,
                "stored_share": round(total["stored"] / total["puts"], 4), "unreported": failed - total["put_failures"],
                **server_stats, "seconds": round(seconds, 1)}
    finally:
        for server in (single, cluster):
            if server is not None:
                server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mib", type=int, default=8, help="memory each server or cluster gets for entries")
    parser.add_argument("--times", type=int, default=3, help="the working set, in budgets")
    parser.add_argument("--value-kib", type=int, default=64, help="the size of each entry's value")
    parser.add_argument("--writers", type=int, default=4, help="processes writing at once")
    parser.add_argument("--passes", type=int, default=2, help="times each entry is written")
    parser.add_argument("--policies", nargs="*", default=["noeviction", "allkeys-lru"])
    parser.add_argument("--cluster", action="store_true", help="also a 3-master Redis Cluster")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line")
    args = parser.parse_args(argv)
    if shutil.which("redis-server") is None:
        print("redis_maxmemory: redis-server is not installed", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="kvtool-maxmemory-"))
    try:
        cases = [one_case(topology, policy, args, work) for topology in ["redis"] + ["redis+cluster"] * args.cluster
                 for policy in args.policies]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps({"cases": cases}))
    else:
        for case in cases:
            print(" ".join(f"{k}={v}" for k, v in case.items()))
    return 1 if any(case["unreported"] for case in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
