"""LMCache with kvtool's L2 adapter against LMCache with its own file adapter (``fs``): the same chunks, host and disk.

    .venv-lmcache/bin/python benchmarks/lmcache_l2/bench.py --out benchmarks/results/lmcache_l2.json

Two parts, both in LMCache 0.5.6's environment (``run.sh`` beside this file builds what
is missing and prints the table):

- ``chunks``: each adapter alone, in this process, as LMCache's server drives it: real
  SmolLM2 chunks (samples/, laid out as LMCache lays out a chunk) stored and loaded back
  into LMCache memory objects, verified bit for bit; process CPU and wall seconds per GB
  of KV, and bytes on disk. Loads read files the store has just written (warm page cache
  for both).
- ``trace``: ``lmcache server`` + vLLM's CPU build with ``LMCacheMPConnector``, vLLM's own
  prefix cache off, an L1 too small for the sessions (``--l1-gb``), so that returning
  turns restore chunks from L2; agent sessions from ``benchmarks/vs_lmcache`` at
  concurrency 1 and 4; TTFT per request, tokens restored, L2 bytes per session, and every
  output compared with vLLM's own prefix cache (``vllm-prefix``, same process mode).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "vs_lmcache"))
import bench as vs  # noqa: E402  (the LMCache comparison's servers, trace and client)

#: What the results keep of each adapter's status (the rest names this machine's folders).
KEPT_STATUS = ("type", "recipe", "workers", "counters", "is_healthy")
KVTOOL = {"type": "plugin", "module_path": "kvtool.integrations.lmcache", "class_name": "KvtoolL2Adapter"}


def adapter_spec(kind: str, path: Path, recipe: str | None = None) -> dict[str, Any]:
    if kind == "fs":
        return {"type": "fs", "base_path": str(path)}
    return {**KVTOOL, "adapter_params": {"store": f"file://{path}", **({"recipe": recipe} if recipe else {})}}


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- part 1: the adapters alone -----------------------------------------------------------

def chunks_part(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    import torch
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    sys.path.insert(0, str(ROOT / "tests" / "lmcache_e2e"))
    from chunk_objects import empty_like, kv_chunk, memory_obj

    sources = [kv_chunk("code.safetensors"), kv_chunk("prose.safetensors")]
    chunks = [memory_obj(sources[i % 2].clone()) for i in range(args.chunks)]
    raw = sum(c.get_size() for c in chunks)
    rows = []
    for kind in args.adapters.split(","):
        for repeat in range(args.repeats):
            path = workdir / f"chunks-{kind}-{repeat}"
            spec = adapter_spec(kind, path)
            config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)])).adapters[0]
            adapter = create_l2_adapter(config)
            keys = [ObjectKey(chunk_hash=(repeat << 32 | i).to_bytes(16, "big"), model_name="m", kv_rank=0)
                    for i in range(len(chunks))]
            try:
                cpu, wall = time.process_time(), time.perf_counter()
                task = adapter.submit_store_task(keys, chunks)
                done: dict = {}
                while task not in done:
                    select.select([adapter.get_store_event_fd()], [], [], 0.01)
                    done.update(adapter.pop_completed_store_tasks())
                store_cpu, store_wall = time.process_time() - cpu, time.perf_counter() - wall
                assert done[task].is_successful()
                outs = [empty_like(c) for c in chunks]
                cpu, wall = time.process_time(), time.perf_counter()
                task = adapter.submit_load_task(keys, outs)
                while (bitmap := adapter.query_load_result(task)) is None:
                    select.select([adapter.get_load_event_fd()], [], [], 0.01)
                load_cpu, load_wall = time.process_time() - cpu, time.perf_counter() - wall
                ok = len(bitmap.get_indices_list()) == len(keys) and all(
                    torch.equal(o.raw_data, c.raw_data) for o, c in zip(outs, chunks))
            finally:
                adapter.close()
            gb = raw / 1e9
            rows.append({"adapter": kind, "repeat": repeat, "chunks": len(chunks), "raw_bytes": raw,
                         "disk_bytes": disk_bytes(path), "store_cpu_s_per_gb": store_cpu / gb,
                         "store_wall_s_per_gb": store_wall / gb, "load_cpu_s_per_gb": load_cpu / gb,
                         "load_wall_s_per_gb": load_wall / gb, "load_wall_s_per_chunk": load_wall / len(chunks),
                         "bit_exact": ok})
            print(f"chunks {kind} #{repeat}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


# -- part 2: the overflow trace under vLLM ------------------------------------------------

async def start_servers(config: str, args: argparse.Namespace, workdir: Path, env: dict) -> dict[str, Any]:
    servers: dict[str, Any] = {"l2_path": None, "lmcache": None}
    extra: dict[str, Any] = {}
    if config != "vllm-prefix":
        mp_port, http_port = vs.free_port(), vs.free_port()
        path = workdir / f"trace-{config}"
        cmd = [str(Path(args.python).with_name("lmcache")), "server", "--host", "127.0.0.1", "--port", str(mp_port),
               "--chunk-size", str(vs.CHUNK), "--l1-size-gb", str(args.l1_gb), "--eviction-policy", "LRU",
               "--supported-transfer-mode", "auto", "--http-host", "127.0.0.1", "--http-port", str(http_port),
               "--prometheus-port", str(vs.free_port()),
               "--l2-adapter", json.dumps(adapter_spec(config, path, args.recipe))]
        log = workdir / f"{config}.lmcache.log"
        servers["lmcache"] = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True)
        await vs.wait_http(f"http://127.0.0.1:{http_port}/healthcheck", servers["lmcache"], log, args.start_timeout)
        servers.update(l2_path=path, http_port=http_port)
        extra = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": mp_port,
                                               "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}
    port = vs.free_port()
    cmd = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model), "--served-model-name",
           "m", "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "4096",
           "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
           "--enable-prefix-caching" if config == "vllm-prefix" else "--no-enable-prefix-caching"]
    if extra:
        cmd += ["--kv-transfer-config", json.dumps(extra)]
    log = workdir / f"{config}.vllm.log"
    servers["vllm"] = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                       start_new_session=True)
    servers["port"] = port
    await vs.wait_http(f"http://127.0.0.1:{port}/health", servers["vllm"], log, args.start_timeout)
    return servers


async def trace_part(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    _, pool, messages = vs.tokenizer_data(args.model)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "LMCACHE_DISABLE_BANNER": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: separate processes
    trace_args = argparse.Namespace(agent_turns=args.turns, agent_context=args.context)
    runs = []
    for config in args.configs.split(","):
        servers = await start_servers(config, args, workdir, env)
        try:
            for concurrency in args.concurrency:
                rng = random.Random(f"{args.seed}-{concurrency}")  # the same sessions for every config
                phase = vs.agent_phase(rng, concurrency, args.sessions, trace_args, pool, messages)
                await vs.run_batch(servers["port"], phase.seeds, concurrency, 1)
                await asyncio.sleep(args.settle)
                rows = []
                for turn, prompts in enumerate(phase.rounds):
                    for session, row in enumerate(await vs.run_batch(servers["port"], prompts, concurrency,
                                                                    args.output_tokens)):
                        rows.append({"turn": turn, "session": session, "stored_before": phase.stored[turn][session],
                                     **row})
                    await asyncio.sleep(args.settle)
                status = None
                if servers["lmcache"] is not None:
                    status = json.loads(vs_get(f"http://127.0.0.1:{servers['http_port']}/status"))
                runs.append({"config": config, "concurrency": concurrency, "sessions": phase.sessions,
                             "requests": rows, "l2_disk_bytes": disk_bytes(servers["l2_path"]) if servers["l2_path"] else None,
                             "l2_adapters": [{k: a[k] for k in KEPT_STATUS if k in a}
                                             for a in status["storage_manager"]["l2_adapters"]] if status else None})
                ttfts = sorted(r["ttft_s"] for r in rows)
                print(f"trace {config} c={concurrency}: TTFT p50 {ttfts[len(ttfts) // 2]:.3f} s, restored "
                      f"{sum(r['cached_tokens'] for r in rows)} tokens", file=sys.stderr, flush=True)
        finally:
            vs.stop(servers["vllm"])
            vs.stop(servers["lmcache"])
    return runs


def vs_get(url: str) -> str:
    import urllib.request

    return urllib.request.urlopen(url, timeout=60).read().decode()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lmcache_l2.json")
    p.add_argument("--parts", default="chunks,trace")
    p.add_argument("--adapters", default="kvtool,fs", help="for the chunks part")
    p.add_argument("--chunks", type=int, default=16, help="chunks per store and load (chunks part)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", default="kvtool,fs,vllm-prefix", help="for the trace part")
    p.add_argument("--recipe", default=None, help="kvtool's recipe (default: the adapter's)")
    p.add_argument("--model", type=Path, default=ROOT / "out" / "smollm2-135m")
    p.add_argument("--python", default=sys.executable, help="LMCache's environment's python")
    p.add_argument("--l1-gb", type=float, default=0.05, help="LMCache's L1: less than the sessions need")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--context", type=int, default=1024, help="tokens of a session's last turn")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--settle", type=float, default=3.0, help="seconds after each round, for stores to finish")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="lmcache-l2-"))
    print(f"work in {workdir}", file=sys.stderr)
    results: dict[str, Any] = {"settings": {k: vs.shown(v) for k, v in vars(args).items()},
                               "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    parts = args.parts.split(",")
    if "chunks" in parts:
        results["chunks"] = chunks_part(args, workdir)
    if "trace" in parts:
        results["trace"] = asyncio.run(trace_part(args, workdir))
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
