"""A differential torture of kvtool's L2 adapter under LMCache's server, vLLM's CPU build and LMCacheMPConnector.

    .venv-lmcache/bin/python benchmarks/torture_lmcache.py --seed 7 --requests 300 --json

The workload of benchmarks/torture.py (seeded sessions over shared prefixes,
several tenants by ``cache_salt``, prompts that end mid-chunk, batches run at
once; its engine, benchmarks/torture_engine.py) runs twice on vLLM's CPU build:
once through vLLM's own prefix cache (the reference), once with vLLM's prefix
cache off and ``LMCacheMPConnector`` to an ``lmcache server`` whose only L2 is
kvtool's adapter over a file tier (and, when ``redis-server`` is installed, a
Redis Cluster below it and a single Redis below that). LMCache keeps no copy in
its L1 once a chunk is in L2 (``--l2-store-policy skip_l1``), so every chunk
vLLM gets back comes out of kvtool's adapter. Faults come between rounds
(benchmarks/torture_faults.py): the LMCache server SIGKILLed and started again
over the same store (vLLM with it: LMCache 0.5.6's connector registers its KV
cache only when vLLM starts), entries bit-flipped or truncated on disk, the file
tier filled to its capacity by other entries (``disk_full``: every put must make
room, as on a full disk), Redis killed and restarted, a cluster master SIGKILLed.
LMCache's chunk size and vLLM's block size are drawn from the seed.

Every output is compared with the reference's as benchmarks/torture.py does
(``wrong``: a difference beyond a near tie; must be 0). ``restores_after_restart``
counts, for each server restart, the requests after it (until the next one) that
got tokens from LMCache. The last line printed is one JSON object (``--json``) or a
table; the exit status is 1 when an output was wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from torture import (Engine, Round, build_workload, compare, engine_spec, report, run_rounds, show_progress,
                     workload_arguments)
from torture_faults import Cluster, Faults, Redis

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ("server_kill", "bitflip", "truncate", "disk_full", "redis_restart", "cluster_master_kill")
SERVER_FAULTS = ("redis_restart", "cluster_master_kill")  # these need redis-server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LMCacheServer:
    """``lmcache server`` with kvtool's adapter on ``store``; its ports are kept, so a restart reuses them."""

    def __init__(self, store: str, chunk_tokens: int, work: Path) -> None:
        self.port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.adapter = {"type": "plugin", "module_path": "kvtool.integrations.lmcache", "class_name": "KvtoolL2Adapter",
                        "adapter_params": {"store": store}}
        self.chunk_tokens, self.work, self.starts = chunk_tokens, work, 0
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.starts += 1
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "LMCACHE_DISABLE_BANNER": "1", "OMP_NUM_THREADS": "1"}
        lmcache = Path(sys.executable).with_name("lmcache")
        with open(self.work / f"lmcache-{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen(
                [str(lmcache), "server", "--host", "127.0.0.1", "--port", str(self.port),
                 "--chunk-size", str(self.chunk_tokens), "--l1-size-gb", "0.25", "--eviction-policy", "LRU",
                 "--l2-store-policy", "skip_l1", "--supported-transfer-mode", "auto",
                 "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                 "--prometheus-port", str(self.metrics_port), "--l2-adapter", json.dumps(self.adapter)],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited ({self.proc.returncode}); see {log.name}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthcheck", timeout=5)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"lmcache server not ready in 600 s; see {log.name}") from None
                time.sleep(1)

    def counters(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/status", timeout=30) as reply:
            (adapter,) = json.load(reply)["storage_manager"]["l2_adapters"]
        return adapter["counters"]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    chunk_tokens = rng.choice(args.chunk_sizes)
    block_size = rng.choice([b for b in args.block_sizes if chunk_tokens % b == 0])
    shape = {"block_size": block_size, "chunk_tokens": chunk_tokens,
             "num_blocks": -(-2048 // block_size) + rng.randrange(2, 8)}
    faults = tuple(f for f in FAULTS if f in args.faults and (f not in SERVER_FAULTS or shutil.which("redis-server")))
    rounds = build_workload(rng, args.requests, args.concurrency, args.fault_rate, faults, args.max_prompt_chars)
    counts = {kind: 0 for kind in FAULTS}
    work = Path(tempfile.mkdtemp(prefix="kvtool-lmcache-torture-"))
    started = time.monotonic()
    redis = cluster = server = None
    engines: list[Engine] = []
    try:
        reference = Engine(engine_spec(args.model, None, True, shape, args.seed), work, "reference")
        reference_out = run_rounds([reference], rounds, args.max_tokens)
        reference.close()

        store_dir = work / "store"
        redis = Redis(work) if "redis_restart" in faults else None
        cluster = Cluster(work) if "cluster_master_kill" in faults else None
        capacity = args.file_capacity_mib << 20
        store_url = ",".join([f"file://{store_dir}?capacity={capacity}"] + [s.url for s in (cluster, redis) if s])
        server = LMCacheServer(store_url, chunk_tokens, work)
        spec = {**engine_spec(args.model, None, False, shape, args.seed), "lmcache_port": server.port}
        engines.append(Engine(spec, work, "lmcache-0"))
        injector = Faults(rng, store_dir, capacity, redis, cluster, counts)
        restarts: list[int] = []  # the round each server restart came before

        def restart_server(kind: str) -> bool:
            """SIGKILL the LMCache server and vLLM, then start both again over the same store."""
            assert server is not None
            server.kill()
            engines[0].kill()
            server.start()
            engines[0] = Engine(spec, work, f"lmcache-{server.starts}")
            return True

        def before_round(number: int, rnd: Round) -> None:
            injector.recover()
            if rnd.fault == "disk_full":
                counts["disk_full"] += injector.fill_tier()
            elif rnd.fault == "server_kill":
                counts["server_kill"] += restart_server("server_kill")
                restarts.append(number)
            elif rnd.fault:
                injector.inject(rnd.fault, restart_server)

        def progress(number: int, outputs: list) -> None:
            show_progress(number, len(rounds), outputs, reference_out, counts, started)

        # One engine: the rounds a fault splits in two run one after the other on it.
        kvtool_out = run_rounds(engines, rounds, args.max_tokens, before_round, progress)
        adapter = server.counters()
        wrong, own, differences = compare(rounds, kvtool_out, reference_out)
        restored = [sum(r["restored"] > 0 for b in kvtool_out[n] for r in b) for n in range(len(rounds))]
        after = [sum(restored[start:end]) for start, end in zip(restarts, restarts[1:] + [len(rounds)])]
    finally:
        for engine in engines:
            engine.close()
        if server is not None:
            server.kill()
        for service in (redis, cluster):  # also when the run failed: no server outlives it
            if service is not None:
                service.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    requests = [r for batches in kvtool_out for results in batches for r in results]
    return {"seed": args.seed, **shape, "concurrency": args.concurrency, "rounds": len(rounds),
            "requests": len(requests), "restored_requests": sum(r["restored"] > 0 for r in requests),
            "restored_tokens": sum(r["restored"] for r in requests), "wrong": wrong, "vllm_own": own,
            "faults": counts, "server_restarts": len(restarts), "restores_after_restart": after,
            "adapter": {k: v for k, v in adapter.items() if not k.endswith("seconds")},
            "differences": differences, "seconds": round(time.monotonic() - started, 1),
            **({"work": str(work)} if args.keep else {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_arguments(parser, FAULTS, [16, 32, 64, 128])
    parser.add_argument("--chunk-sizes", type=int, nargs="*", default=[128, 256], help="LMCache's chunk sizes")
    args = parser.parse_args(argv)
    print(f"lmcache torture: seed {args.seed}, {args.requests} requests", file=sys.stderr, flush=True)
    result = run(args)
    report(result, args.json)
    return 1 if result["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
