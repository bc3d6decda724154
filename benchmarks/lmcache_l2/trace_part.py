"""The trace part: agent sessions served by vLLM's CPU build, each configuration of a cell on its own servers.

- LMCache configurations (``fs``, ``kvtool``, ``kvtool-redis``...): ``lmcache server``
  (L1 ``--l1-gb``, smaller than the sessions) with the cell's L2 adapter inside the
  timing wrapper (``timed_adapter.py``), and vLLM with ``LMCacheMPConnector``;
- ``kvtool-connector``: kvtool's own vLLM connector (timed, ``benchmarks/vs_lmcache``)
  over the same two levels: a memory tier of the L1's size over the cell's L2;
- ``vllm-prefix``: vLLM's own prefix cache, the outputs every restored request must equal.

vLLM's prefix cache is off but in the reference, and every vLLM runs in its default
multiprocessing mode, so all configurations share one reference. Per concurrency: each
session's earlier context is stored first (untimed), then each turn of every session
(timed), with the same wait after each round for stores to finish. Before each timed
round of the cold cell the page cache of the configuration's L2 files is dropped.
Recorded per phase: each request's TTFT, tokens restored and output; each L2 load task
(LMCache's, from the wrapper) or the connector's restore time; L2 bytes held; what
stayed cached after each drop.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import aiohttp

from cells import REFERENCE, ADAPTERS, Cell, Place, connector_store, lmcache_spec
from pagecache import drop, files, resident_bytes

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "vs_lmcache"))
import bench as vs  # the LMCache comparison's servers, trace and client

#: What the results keep of each adapter's status (the rest names this machine's folders).
KEPT_STATUS = ("type", "recipe", "workers", "counters", "is_healthy", "chunks_indexed")
CONNECTOR = "kvtool-connector"


@dataclass
class Servers:
    vllm: subprocess.Popen | None = None
    lmcache: subprocess.Popen | None = None
    port: int = 0
    http_port: int | None = None
    place: Place | None = None
    timings: Path | None = None  # the wrapper's load lines (LMCache configurations)
    stats: Path | None = None  # the timed connector's totals (kvtool's connector)
    vllm_log: Path | None = None


def kind_of(config: str) -> str:
    base = config.split("@")[0]
    return "lmcache" if base in ADAPTERS else base


async def start(config: str, place: Place | None, args: Namespace, workdir: Path, env: dict) -> Servers:
    servers = Servers(place=place)
    try:
        await _start(servers, config, args, workdir, env)
    except BaseException:
        stop(servers)
        raise
    return servers


async def _start(servers: Servers, config: str, args: Namespace, workdir: Path, env: dict) -> None:
    extra: dict[str, Any] = {}
    kind = kind_of(config)
    place = servers.place
    if kind == "lmcache":
        assert place is not None
        mp_port, servers.http_port = vs.free_port(), vs.free_port()
        servers.timings = workdir / f"{config}.loads.jsonl"
        spec = lmcache_spec(config.split("@")[0], place, servers.timings)
        cmd = [str(Path(args.python).with_name("lmcache")), "server", "--host", "127.0.0.1", "--port", str(mp_port),
               "--chunk-size", str(vs.CHUNK), "--l1-size-gb", str(args.l1_gb), "--eviction-policy", "LRU",
               "--supported-transfer-mode", "auto", "--http-host", "127.0.0.1", "--http-port", str(servers.http_port),
               "--prometheus-port", str(vs.free_port()), "--l2-adapter", json.dumps(spec)]
        log = workdir / f"{config}.lmcache.log"
        servers.lmcache = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True)
        await vs.wait_http(f"http://127.0.0.1:{servers.http_port}/healthcheck", servers.lmcache, log,
                           args.start_timeout)
        extra = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": mp_port,
                                               "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}
    elif kind == CONNECTOR:
        assert place is not None
        servers.stats = workdir / f"{config}.kvtool.json"
        env = {**env, "KVTOOL_BENCH_STATS": str(servers.stats)}
        extra = {"kv_connector": "TimedKvtoolConnector", "kv_connector_module_path": "benchmarks.vs_lmcache.timed_connector",
                 "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                 "kv_connector_extra_config": {"store": connector_store(place, int(args.l1_gb * 2**30)),
                                               "chunk_tokens": vs.CHUNK}}
    servers.port = vs.free_port()
    cmd = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model), "--served-model-name",
           "m", "--host", "127.0.0.1", "--port", str(servers.port), "--dtype", "bfloat16", "--max-model-len", "4096",
           "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
           "--enable-prefix-caching" if kind == REFERENCE else "--no-enable-prefix-caching"]
    if extra:
        cmd += ["--kv-transfer-config", json.dumps(extra)]
    log = servers.vllm_log = workdir / f"{config}.vllm.log"
    servers.vllm = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                    start_new_session=True)
    await vs.wait_http(f"http://127.0.0.1:{servers.port}/health", servers.vllm, log, args.start_timeout)


def stop(servers: Servers) -> None:
    vs.stop(servers.vllm)
    vs.stop(servers.lmcache)
    release_shared_kv(servers.vllm_log)


def release_shared_kv(vllm_log: Path | None) -> None:
    """Unlink the shared-memory segments LMCache's connector left behind for a stopped vLLM.

    ``LMCacheMPConnector`` moves the worker's KV cache (``VLLM_CPU_KVCACHE_SPACE``, 1 GiB here) into
    ``/dev/shm/lmcache_kv_<worker pid>_<n>`` and, in 0.5.6, leaves it there when vLLM stops: every run would
    leave a GiB of memory taken on the machine. The pids are those vLLM's log names; only segments of
    processes that are gone are removed."""
    if vllm_log is None or not vllm_log.exists():
        return
    deadline = time.monotonic() + 30  # vLLM's worker processes end a little after its API server
    for pid in set(re.findall(r"\(\w+ pid=(\d+)\)", vllm_log.read_text(errors="replace"))):
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if Path(f"/proc/{pid}").exists():
            continue
        for segment in Path("/dev/shm").glob(f"lmcache_kv_{pid}_*"):
            segment.unlink(missing_ok=True)


def _lines(path: Path | None) -> list[dict[str, Any]]:
    if path is None or not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _stats(path: Path | None) -> dict[str, Any]:
    return json.loads(path.read_text()) if path is not None and path.exists() else {}


def _status(servers: Servers) -> list[dict[str, Any]] | None:
    if servers.http_port is None:
        return None
    status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{servers.http_port}/status", timeout=60).read())
    return [{k: a[k] for k in KEPT_STATUS if k in a} for a in status["storage_manager"]["l2_adapters"]]


async def run_phase(servers: Servers, config: str, concurrency: int, cell: Cell, args: Namespace,
                    pool: list[int], messages: list[list[int]]) -> dict[str, Any]:
    rng = random.Random(f"{args.seed}-{concurrency}")  # the same sessions for every configuration
    trace_args = Namespace(agent_turns=args.turns, agent_context=args.context)
    phase = vs.agent_phase(rng, concurrency, args.sessions, trace_args, pool, messages)
    await vs.run_batch(servers.port, phase.seeds, concurrency, 1)
    await asyncio.sleep(args.settle)
    loads_before, stats_before = len(_lines(servers.timings)), _stats(servers.stats)
    rows, resident = [], []
    folder = servers.place.folder if servers.place is not None else None
    for turn, prompts in enumerate(phase.rounds):
        if cell.cold and folder is not None and kind_of(config) != REFERENCE:
            drop(folder)
            resident.append(resident_bytes(folder))
        batch = await vs.run_batch(servers.port, prompts, concurrency, args.output_tokens, args.logprobs)
        for session, row in enumerate(batch):
            rows.append({"turn": turn, "session": session, "stored_before": phase.stored[turn][session], **row})
        await asyncio.sleep(args.settle)
    stats_after = _stats(servers.stats)
    return {"config": config, "concurrency": concurrency, "sessions": phase.sessions, "requests": rows,
            "l2_loads": _lines(servers.timings)[loads_before:],
            "connector": {"before": stats_before.get("phases", {}), "after": stats_after.get("phases", {}),
                          "store": stats_after.get("store")} if servers.stats else None,
            "l2_disk_bytes": sum(p.stat().st_size for p in files(folder)) if folder else None,
            "l2_adapters": _status(servers), "resident_after_drop": resident,
            "budget_bytes": servers.place.budget_bytes if servers.place else 0}


async def run(cell: Cell, configs: tuple[str, ...], args: Namespace, workdir: Path,
              place_of: Callable[[str], Place], label: str = "") -> list[dict[str, Any]]:
    _, pool, messages = vs.tokenizer_data(args.model)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "LMCACHE_DISABLE_BANNER": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: separate processes
    phases = []
    for config in configs:
        name = config if kind_of(config) == REFERENCE else config + label
        place = None if kind_of(config) == REFERENCE else place_of(f"trace-{name}")
        try:
            servers = await start(name, place, args, workdir, env)
        except RuntimeError as exc:  # a server that did not come up: recorded, and the cell goes on
            phases.append({"config": name, "error": str(exc)})
            continue
        try:
            for concurrency in args.concurrency:
                phases.append(await run_phase(servers, name, concurrency, cell, args, pool, messages))
                ttfts = sorted(r["ttft_s"] for r in phases[-1]["requests"])
                print(f"trace {name} c={concurrency}: TTFT p50 {ttfts[len(ttfts) // 2]:.3f} s, restored "
                      f"{sum(r['cached_tokens'] for r in phases[-1]['requests'])} tokens, "
                      f"{len(phases[-1]['l2_loads'])} L2 load tasks", flush=True)
        except (RuntimeError, OSError, aiohttp.ClientError) as exc:  # vLLM's engine died or dropped the request
            # (an overloaded machine times vLLM's own RPCs out): recorded, and the cell goes on
            phases.append({"config": name, "concurrency": concurrency, "error": str(exc)})
            print(f"trace {name} c={concurrency}: {exc}", flush=True)
        finally:
            stop(servers)
    return phases
