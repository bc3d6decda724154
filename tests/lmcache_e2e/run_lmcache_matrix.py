"""The model matrix's families under LMCache's server with kvtool's L2 adapter and vLLM's LMCacheMPConnector.

    python run_lmcache_matrix.py SPEC.json

SPEC: {"models": DIR, "store": URL, "families": [NAME, ...]} (families from tests/vllm_e2e/families.py,
each model folder ``DIR/NAME``). One ``lmcache server`` whose only L2 is kvtool on ``store``; per family
one vLLM engine (vLLM's default multiprocessing, its own prefix cache on): the prompt is computed
(``cold``; LMCache stores its chunks, kvtool's adapter keeps them), asked again (``warm``: vLLM's
prefix cache, or LMCache's memory where vLLM turns its own off), then with vLLM's prefix cache and
LMCache's memory emptied (``restored``: the chunks must come from kvtool's store), then so again
under another ``cache_salt`` (``salted``: nothing may be loaded). One JSON line per family
(``FAMILY {...}``) with each step's tokens, their log-probabilities, vLLM's cached tokens and the
chunks the adapter loaded; a family vLLM or LMCache cannot start is reported with its error.
vLLM's dummy weights are drawn as in ``run_matrix.py`` (at import: the engine process vLLM spawns
runs this module's top level too).
"""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "vllm_e2e"))

from families import DUMMY_RANGE, FAMILIES, MAX_TOKENS, PROMPT, SUFFIX, dummy_weights_in, vllm_error

dummy_weights_in(DUMMY_RANGE)
CHUNK = 256
KV_CACHE_BYTES = 96 * 2**20  # LMCache's connector maps vLLM's whole KV cache into /dev/shm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=120))


class Server:
    """``lmcache server`` with kvtool's adapter on ``store``."""

    def __init__(self, store: str, log: Path) -> None:
        self.port, self.http_port = free_port(), free_port()
        adapter = {"type": "plugin", "module_path": "kvtool.integrations.lmcache", "class_name": "KvtoolL2Adapter",
                   "adapter_params": {"store": store}}
        with open(log, "wb") as out:  # the server keeps its own copy of the descriptor
            self.proc = self._start(out, adapter)
        deadline = time.monotonic() + 300
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"lmcache server did not start: {log.read_text(errors='replace')[-3000:]}")
            time.sleep(1)

    def _start(self, out, adapter: dict) -> subprocess.Popen:
        return subprocess.Popen(
            [str(Path(sys.executable).with_name("lmcache")), "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--chunk-size", str(CHUNK), "--l1-size-gb", "0.5", "--eviction-policy", "LRU",
             "--supported-transfer-mode", "auto", "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
             "--prometheus-port", str(free_port()), "--l2-adapter", json.dumps(adapter)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def _healthy(self) -> bool:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthcheck", timeout=5).status == 200
        except OSError:
            return False

    def loaded(self) -> int:
        (adapter,) = http(f"http://127.0.0.1:{self.http_port}/status")["storage_manager"]["l2_adapters"]
        return adapter["counters"].get("chunks_loaded", 0)

    def clear_l1(self) -> None:
        http(f"http://127.0.0.1:{self.http_port}/cache/clear", {"tier": "l1", "force": True})

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@contextlib.contextmanager
def engine_processes(log: Path, server: int) -> Iterator[None]:
    """While it runs, the processes this one starts (vLLM's engine and worker, not the ``server``) write their stderr
    into ``log``; afterwards the shared-memory copy of the KV cache LMCache's connector made for each is removed,
    whether the engine started or not."""
    import psutil

    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            seen.update(p.pid for p in psutil.Process().children(recursive=True) if p.pid != server)

    saved = os.dup(2)
    with open(log, "wb") as out:
        os.dup2(out.fileno(), 2)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        os.dup2(saved, 2)
        os.close(saved)
        for pid in seen:
            for leftover in Path("/dev/shm").glob(f"lmcache_kv_{pid}_*"):
                leftover.unlink(missing_ok=True)


def root_cause(log: Path, error: str) -> str:
    """vLLM's own words for why its engine did not start (its processes log them), else ``error``."""
    causes = re.findall(r"\((?:EngineCore|Worker)[^)]*\).*?\b(\w+(?:Error|Exception): .+)", log.read_text(errors="replace"))
    return causes[0] if causes and "Engine core initialization failed" in error else error


def run_family(family, spec: dict, server: Server) -> dict:
    """One family's row. An engine that fails to start without saying why (seen once on a loaded machine, the
    next start of the same family fine) is started once more, and says so; a failure with a reason is the row."""
    for attempt in (1, 2):
        log = Path(spec["models"]) / f"{family.name}.engine.{attempt}.log"
        with engine_processes(log, server.proc.pid):
            row = run_engine(family, spec, server)
        if "error" not in row:
            return row
        row["error"] = root_cause(log, row["error"])
        if attempt == 1 and "Engine core initialization failed" in row["error"]:
            print(f"{family.name}: vLLM's engine did not start and gave no reason (log {log}); starting it once more",
                  file=sys.stderr, flush=True)
            continue
        return row
    return row


def run_engine(family, spec: dict, server: Server) -> dict:
    from vllm import LLM, SamplingParams

    row: dict = {"family": family.name}
    try:
        llm = LLM(model=str(Path(spec["models"]) / family.name), load_format="dummy", max_model_len=1024,
                  enforce_eager=True, enable_prefix_caching=True, dtype="bfloat16", seed=0,
                  kv_cache_memory_bytes=KV_CACHE_BYTES, kv_transfer_config={
                      "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": server.port,
                                                    "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}, **family.engine)
    except Exception as exc:  # noqa: BLE001 - vLLM's or LMCache's reason is the row's result
        return {**row, "error": vllm_error(exc)}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1)
    try:
        for name, salt in (("cold", None), ("warm", None), ("restored", None), ("salted", "another-tenant")):
            if name in ("restored", "salted"):
                time.sleep(2)  # LMCache hands its chunks to the adapter in the background
                llm.reset_prefix_cache()
                server.clear_l1()
            before = server.loaded()
            out = llm.generate([{"prompt": PROMPT + SUFFIX, **({"cache_salt": salt} if salt else {})}], params,
                               use_tqdm=False)[0]
            tokens = list(out.outputs[0].token_ids)
            row[name] = {"tokens": tokens, "logprobs": [lp[t].logprob for t, lp in zip(tokens, out.outputs[0].logprobs)],
                         "vllm_cached": out.num_cached_tokens, "chunks_loaded": server.loaded() - before}
    except Exception as exc:  # noqa: BLE001
        row["error"] = vllm_error(exc)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return row


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    server = Server(spec["store"], Path(sys.argv[1]).with_suffix(".lmcache.log"))
    by_name = {f.name: f for f in FAMILIES}
    try:
        for name in spec["families"]:
            started = time.perf_counter()
            row = run_family(by_name[name], spec, server)
            row["seconds"] = round(time.perf_counter() - started, 1)
            print("FAMILY " + json.dumps(row), flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
