"""kvtool against LMCache on one vLLM: the same model, prompts and waits; TTFT, tokens restored, bytes held.

    python benchmarks/vs_lmcache/bench.py --out benchmarks/results/vs_lmcache.json

Run it with a python that has aiohttp and psutil (kvtool's vLLM environment has both);
``run.sh`` beside it builds what it needs and runs everything. Each configuration gets
a fresh vLLM server (and a fresh LMCache server), in an order that is interleaved
and repeated; every repeat draws new prompts, shared by the configurations of that repeat:

- ``vllm``: no connector, vLLM's prefix cache off: every prompt computed in full;
- ``vllm-prefix``: no connector, vLLM's own prefix cache on: the outputs a restored
  prefix must reproduce, and the floor no offload can beat;
- ``lmcache``: LMCache's multi-process server and vLLM's ``LMCacheMPConnector``;
- ``kvtool``: kvtool's connector on a memory store, the default recipe;
- ``kvtool-none``: the same, entries uncompressed (recipe ``none``).

vLLM's prefix cache is off in every configuration but ``vllm-prefix``, so a reused
prefix can only come from the connector. Workloads, each at concurrency 1 and 4:

- ``shared``: KVShrink's serving shape (vLLM's random dataset): a prompt of random
  tokens whose first 80% is a prefix shared by every request, stored by one untimed
  request first; the timed requests add their own random suffix;
- ``agent``: coding-agent sessions (``kvtool.bench.trace``, real text and code from
  samples/texts): each session's earlier context is stored first, then every turn is the
  previous prompt plus a user message and a tool output.

Stores complete after a request returns, so every request that is meant to be stored
is followed by the same wait (``--settle``) in every configuration. A capacity phase
then gives LMCache and kvtool the same small memory budget for more agent sessions than
fit uncompressed, and reports hits and TTFT. TTFT is measured by the client: request
sent to first streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from kvtool.bench.trace import build_trace, read_texts  # noqa: E402

#: What a user says between an agent's tool outputs; each agent turn starts with one.
USER_MESSAGES = (
    "Summarise what the tool returned and decide the next step.",
    "Check this output against the earlier one and list the differences.",
    "Which part of this is relevant to the task? Quote it.",
    "Continue with the plan; call the next tool if you need more context.",
)

CHUNK = 256  # tokens per entry: kvtool's chunk_tokens and LMCache's --chunk-size


@dataclass
class Config:
    name: str
    python: str
    connector: str | None  # None, "lmcache" or a kvtool recipe
    prefix_cache: bool = False
    multiprocessing: bool = False


@dataclass
class Servers:
    vllm: subprocess.Popen
    lmcache: subprocess.Popen | None
    port: int
    lmcache_http: int | None
    stats_file: Path | None
    log: Path
    extra: dict = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree_cpu(pid: int) -> float:
    """User + system CPU seconds of a process and its live children."""
    try:
        root = psutil.Process(pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            t = p.cpu_times()
            total += t.user + t.system
        return total
    except psutil.Error:
        return float("nan")


def stop(proc: subprocess.Popen | None, grace: float = 30.0) -> None:
    """SIGINT to the server's own process group, then SIGKILL after ``grace`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


async def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}); see {log}")
            try:
                async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(1)
    raise RuntimeError(f"server not ready after {timeout:.0f} s; see {log}")


async def start(config: Config, args: argparse.Namespace, workdir: Path, tag: str, budget_gb: float) -> Servers:
    # One compute thread in both process modes: vLLM serves with one torch thread in a single
    # process, but binds one OpenMP thread per core in its separate worker process, which on a
    # shared machine spins against everything else.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gb), "PYTHONHASHSEED": "0",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if config.multiprocessing else "0",
           "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    log = workdir / f"{tag}.vllm.log"
    lmcache = lmcache_http = stats_file = None
    extra: dict[str, Any] = {}
    if config.connector == "lmcache":
        mp_port, lmcache_http = free_port(), free_port()
        lmcache_log = workdir / f"{tag}.lmcache.log"
        lmcache = subprocess.Popen(
            [str(Path(config.python).with_name("lmcache")), "server", "--host", "127.0.0.1", "--port", str(mp_port),
             "--chunk-size", str(CHUNK), "--l1-size-gb", str(budget_gb), "--eviction-policy", "LRU",
             "--supported-transfer-mode", "auto",
             "--http-host", "127.0.0.1", "--http-port", str(lmcache_http)],
            stdout=open(lmcache_log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        await wait_http(f"http://127.0.0.1:{lmcache_http}/healthcheck", lmcache, lmcache_log, args.start_timeout)
        extra = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": mp_port,
                                               "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}
    elif config.connector is not None:
        stats_file = workdir / f"{tag}.kvtool.json"
        env["KVTOOL_BENCH_STATS"] = str(stats_file)
        extra = {"kv_connector": "TimedKvtoolConnector",
                 "kv_connector_module_path": "benchmarks.vs_lmcache.timed_connector",
                 "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                 "kv_connector_extra_config": {"store": f"memory://?capacity={int(budget_gb * 2**30)}",
                                               "recipe": config.connector, "chunk_tokens": CHUNK}}
    port = free_port()
    cmd = [config.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
           "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
           "--max-model-len", str(args.max_model_len), "--enforce-eager", "--seed", "0",
           "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
           "--enable-prefix-caching" if config.prefix_cache else "--no-enable-prefix-caching"]
    if extra:
        cmd += ["--kv-transfer-config", json.dumps(extra)]
    vllm = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        await wait_http(f"http://127.0.0.1:{port}/health", vllm, log, args.start_timeout)
    except BaseException:
        stop(vllm)
        stop(lmcache)
        raise
    return Servers(vllm, lmcache, port, lmcache_http, stats_file, log)


# -- requests ------------------------------------------------------------------------------

async def complete(http: aiohttp.ClientSession, port: int, tokens: list[int], max_tokens: int,
                   logprobs: int = 0) -> dict[str, Any]:
    """One streamed greedy completion; with ``logprobs``, each output token's top candidates too (``top``: a list
    per token of [token id, log-probability] pairs), to tell a near tie from a wrong cache."""
    body = {"model": "m", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if logprobs:
        body.update(logprobs=logprobs, return_tokens_as_token_ids=True)
    sent = time.perf_counter()
    ttft = None
    out: list[int] = []
    top: list[list[list[float]]] = []
    usage: dict[str, Any] = {}
    async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:500]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - sent
                out.extend(ids)
                for candidates in (choice.get("logprobs") or {}).get("top_logprobs") or ():
                    top.append([[int(t.removeprefix("token_id:")), lp] for t, lp in candidates.items()])
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - sent, "prompt_tokens": len(tokens),
            "cached_tokens": details.get("cached_tokens") or 0, "output": out, **({"top": top} if logprobs else {})}


async def run_batch(port: int, prompts: list[list[int]], concurrency: int, max_tokens: int,
                    logprobs: int = 0) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async def one(tokens: list[int]) -> dict:
            async with gate:
                return await complete(http, port, tokens, max_tokens, logprobs)
        return list(await asyncio.gather(*(one(p) for p in prompts)))


# -- workloads -----------------------------------------------------------------------------

@dataclass
class Phase:
    """One workload at one concurrency: the untimed requests that store its context, then the timed turns."""

    workload: str
    concurrency: int
    seeds: list[list[int]]  # stored first, untimed
    rounds: list[list[list[int]]]  # each round's prompts run together at ``concurrency``; a settle after each
    sessions: int
    stored: list[list[int]]  # per round and prompt: leading tokens stored before it (what a connector can restore)


def shared_phase(rng: random.Random, concurrency: int, args: argparse.Namespace, vocab: int) -> Phase:
    draw = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
    prefix = draw(args.shared_prefix)
    count = max(args.shared_requests, concurrency)
    prompts = [prefix + draw(args.shared_suffix) for _ in range(count)]
    return Phase("shared", concurrency, [prefix], [prompts], sessions=count, stored=[[len(prefix)] * count])


def agent_phase(rng: random.Random, concurrency: int, sessions: int, args: argparse.Namespace, pool: list[int],
                messages: list[list[int]]) -> Phase:
    traces = [build_trace(pool, turns=args.agent_turns, hit_rate=0.8, max_context=args.agent_context,
                          chunk_tokens=CHUNK, seed=rng.randrange(1 << 30), user_message_tokens=messages)
              for _ in range(sessions)]
    seeds = [t[0].tokens[: t[0].cached_tokens] for t in traces]
    rounds = [[t[turn].tokens for t in traces] for turn in range(args.agent_turns)]
    stored = [[t[turn].cached_tokens for t in traces] for turn in range(args.agent_turns)]
    return Phase("agent", concurrency, seeds, rounds, sessions=sessions, stored=stored)


def snapshot(servers: Servers, lmcache_status: dict | None) -> dict[str, Any]:
    snap: dict[str, Any] = {"time": time.perf_counter()}
    if servers.lmcache is not None:
        snap["connector_cpu_s"] = process_tree_cpu(servers.lmcache.pid)
        snap["lmcache_storage"] = lmcache_status["storage_manager"]  # its memory figures; the rest holds local paths
    if servers.stats_file is not None and servers.stats_file.exists():
        snap["kvtool"] = json.loads(servers.stats_file.read_text())
    snap["vllm_cpu_s"] = process_tree_cpu(servers.vllm.pid)
    return snap


async def lmcache_status(servers: Servers) -> dict | None:
    if servers.lmcache_http is None:
        return None
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{servers.lmcache_http}/status") as r:
            return await r.json()


async def run_phase(servers: Servers, phase: Phase, args: argparse.Namespace) -> dict[str, Any]:
    start = snapshot(servers, await lmcache_status(servers))
    await run_batch(servers.port, phase.seeds, phase.concurrency, 1)
    await asyncio.sleep(args.settle)
    before = snapshot(servers, await lmcache_status(servers))
    rows = []
    for turn, prompts in enumerate(phase.rounds):
        for session, row in enumerate(await run_batch(servers.port, prompts, phase.concurrency, args.output_tokens)):
            rows.append({"turn": turn, "session": session, "stored_before": phase.stored[turn][session], **row})
        await asyncio.sleep(args.settle)
    after = snapshot(servers, await lmcache_status(servers))
    return {"workload": phase.workload, "concurrency": phase.concurrency, "sessions": phase.sessions,
            "requests": rows, "start": start, "before": before, "after": after}


# -- the run -------------------------------------------------------------------------------

def configs(args: argparse.Namespace) -> list[Config]:
    kv, lm = args.kvtool_python, args.lmcache_python
    every = {
        "vllm": Config("vllm", kv, None),
        "vllm-prefix": Config("vllm-prefix", kv, None, prefix_cache=True),
        "vllm-prefix-mp": Config("vllm-prefix-mp", lm, None, prefix_cache=True, multiprocessing=True),
        "lmcache": Config("lmcache", lm, "lmcache", multiprocessing=not args.lmcache_single_process),
        "kvtool": Config("kvtool", kv, "exphuff"),
        "kvtool-none": Config("kvtool-none", kv, "none"),
    }
    return [every[name] for name in args.configs.split(",")]


def shown(value: Any) -> Any:
    """A setting as the results record it: a path inside the repository relative to it, an outside one by name."""
    if not isinstance(value, (str, Path)) or os.sep not in str(value):
        return value
    path = Path(os.path.abspath(value))  # not resolve(): a venv's python links outside it
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else f"(outside the repository) {path.name}"


def kv_bytes_per_token(model: Path) -> int:
    """Bytes of K and V per token over all layers in vLLM's bfloat16 cache."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * 2


def tokenizer_data(model: Path) -> tuple[int, list[int], list[list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    pool = tok(read_texts(), add_special_tokens=False)["input_ids"]
    messages = [tok("\n\nUser: " + m + "\n\nTool output:\n", add_special_tokens=False)["input_ids"] for m in USER_MESSAGES]
    return len(tok), pool, messages


async def main_async(args: argparse.Namespace) -> None:
    vocab, pool, messages = tokenizer_data(args.model)
    results: dict[str, Any] = {"settings": {k: shown(v) for k, v in vars(args).items()},
                               "kv_bytes_per_token": kv_bytes_per_token(args.model), "runs": [],
                               "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    order = configs(args)
    workdir = Path(tempfile.mkdtemp(prefix="vs-lmcache-"))
    print(f"logs in {workdir}", file=sys.stderr)

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results))

    plan = []
    once = set(args.first_repeat_only.split(","))
    for repeat in range(args.repeats):
        chosen = [c for c in order if repeat == 0 or c.name not in once]
        shift = repeat % len(chosen)
        for config in chosen[shift:] + chosen[:shift]:  # a new order each repeat
            plan.append(("main", repeat, config))
    capacity = [c for c in order if c.name in ("lmcache", "kvtool")] if args.capacity_sessions else []
    for repeat in range(args.capacity_repeats):
        for config in (capacity if repeat % 2 == 0 else capacity[::-1]):
            plan.append(("capacity", repeat, config))

    for kind, repeat, config in plan:
        rng = random.Random(f"{args.seed}-{kind}-{repeat}")  # the same prompts for every config of a repeat
        if kind == "main":
            phases = [shared_phase(rng, c, args, vocab) for c in args.concurrency]
            phases += [agent_phase(rng, c, max(args.agent_sessions, c), args, pool, messages) for c in args.concurrency]
            budget = args.budget_gb
        else:
            phases = [agent_phase(rng, 1, args.capacity_sessions, args, pool, messages)]
            budget = args.capacity_gb
        tag = f"{kind}-{repeat}-{config.name}"
        print(f"[{time.strftime('%H:%M:%S')}] {tag}: starting", file=sys.stderr, flush=True)
        servers = await start(config, args, workdir, tag, budget)
        run = {"kind": kind, "repeat": repeat, "config": config.name, "budget_gb": budget,
               "multiprocessing": config.multiprocessing, "phases": []}
        try:
            for phase in phases:
                run["phases"].append(await run_phase(servers, phase, args))
                p = run["phases"][-1]
                ttfts = sorted(r["ttft_s"] for r in p["requests"])
                print(f"  {phase.workload} c={phase.concurrency}: TTFT p50 {ttfts[len(ttfts) // 2]:.2f} s, "
                      f"restored {sum(r['cached_tokens'] for r in p['requests'])} tokens", file=sys.stderr, flush=True)
        finally:
            stop(servers.vllm)
            run["final"] = json.loads(servers.stats_file.read_text()) if servers.stats_file and servers.stats_file.exists() else None
            stop(servers.lmcache)
            results["runs"].append(run)
            save()
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vs_lmcache.json")
    p.add_argument("--model", type=Path, default=ROOT / "out" / "smollm2-135m")
    p.add_argument("--kvtool-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--lmcache-python", default=str(ROOT / ".venv-lmcache" / "bin" / "python"))
    p.add_argument("--configs", default="lmcache,kvtool,kvtool-none,vllm-prefix,vllm,vllm-prefix-mp")
    p.add_argument("--first-repeat-only", default="vllm,vllm-prefix-mp",
                   help="configurations run in the first repeat only (the slow recompute, the second reference)")
    p.add_argument("--lmcache-single-process", action="store_true",
                   help="run LMCache's vLLM with VLLM_ENABLE_V1_MULTIPROCESSING=0, as kvtool's (there its "
                        "deferred loads wait about 10 s for the engine's next poll)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--shared-prefix", type=int, default=512, help="KVShrink: 6400")
    p.add_argument("--shared-suffix", type=int, default=128, help="KVShrink: 1600")
    p.add_argument("--shared-requests", type=int, default=3, help="KVShrink: 10 (at least the concurrency)")
    p.add_argument("--output-tokens", type=int, default=8, help="KVShrink: 128")
    p.add_argument("--agent-sessions", type=int, default=2, help="at least the concurrency")
    p.add_argument("--agent-turns", type=int, default=2)
    p.add_argument("--agent-context", type=int, default=1024, help="tokens of the last turn")
    p.add_argument("--settle", type=float, default=2.0, help="seconds after each round, for stores to finish")
    p.add_argument("--budget-gb", type=float, default=2.0, help="GiB of LMCache's L1 and of kvtool's memory store")
    p.add_argument("--capacity-sessions", type=int, default=5, help="0: no capacity phase")
    p.add_argument("--capacity-gb", type=float, default=0.09, help="GiB, for both")
    p.add_argument("--capacity-repeats", type=int, default=1)
    p.add_argument("--vllm-kv-gb", type=int, default=1, help="vLLM's own KV cache (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--threads", type=int, default=1, help="vLLM's compute threads (OMP_NUM_THREADS)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main_async(parse_args()))
