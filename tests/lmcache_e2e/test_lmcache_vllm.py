"""``lmcache server`` with kvtool's L2 adapter under vLLM's CPU build and ``LMCacheMPConnector``, as docs/LMCACHE.md runs them.

    .venv-lmcache/bin/python -m pytest tests/lmcache_e2e/test_lmcache_vllm.py

One vLLM server (default multiprocessing, its own prefix cache on) and one
LMCache server whose only L2 is kvtool on a file store. A prompt of four
256-token chunks is computed once, then repeated: vLLM's own prefix cache
answers, and that output is the reference. With vLLM's prefix cache reset and
LMCache's L1 cleared, the prompt again must restore its chunks from the kvtool
tier (the adapter's counters in LMCache's ``/status`` say so) with the same
output. The LMCache server is then killed (SIGKILL) and started again on the
same store, and vLLM with it (its connector registers with the server only
when it starts): the chunks are found again and served. Another ``cache_salt``
restores nothing. Greedy decoding, 8 tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed here: create its environment with "
                                      "benchmarks/vs_lmcache/lmcache-env.sh")
pytest.importorskip("vllm", reason="vLLM is not installed beside LMCache here: benchmarks/vs_lmcache/lmcache-env.sh")

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "samples" / "texts" / "GPL-3.txt"
CHUNK = 256
#: vLLM's KV cache: room for one 2048-token sequence (SmolLM2: 23 KB a token) and then some. LMCache's
#: connector moves it into a POSIX shared-memory segment for its server, so it must fit in /dev/shm,
#: which is 64 MiB in a default container.
KV_CACHE_BYTES = 96 * 2**20
#: What vLLM's message queues between its processes reserve in /dev/shm (its checks ask for 160 and 240 MiB).
VLLM_SHM_BYTES = 400 * 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, method: str | None = None, timeout: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method or ("GET" if body is None else "POST"),
                                     headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=timeout))


def log_excerpt(log: Path, tail: int = 3000) -> str:
    """The log's first error lines (a failed engine's root cause comes long before its last lines), then its end."""
    text = log.read_text(errors="replace")
    marks = ("Error", "Exception", "error:", "Traceback", "Killed", "CRITICAL")
    errors = [line for line in text.splitlines() if any(mark in line for mark in marks)][:40]
    return "first error lines:\n" + "\n".join(errors) + f"\n... last {tail} characters:\n" + text[-tail:]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log_excerpt(log)}"
        try:
            if urllib.request.urlopen(url, timeout=5).status == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"not ready after {timeout:.0f} s:\n{log_excerpt(log)}"
        time.sleep(1)


def stop(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class LMCacheServer:
    """``lmcache server`` with the kvtool adapter on ``store``; ports fixed at creation, so a restart reuses them."""

    def __init__(self, store: str, workdir: Path, env: dict) -> None:
        self.port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.adapter = {"type": "plugin", "module_path": "kvtool.integrations.lmcache",
                        "class_name": "KvtoolL2Adapter", "adapter_params": {"store": store}}
        self.workdir, self.env, self.starts = workdir, env, 0
        self.start()

    def start(self) -> None:
        self.starts += 1
        self.log = self.workdir / f"lmcache-{self.starts}.log"
        lmcache = Path(sys.executable).with_name("lmcache")
        self.proc = subprocess.Popen(
            [str(lmcache), "server", "--host", "127.0.0.1", "--port", str(self.port), "--chunk-size", str(CHUNK),
             "--l1-size-gb", "0.5", "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
             "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
             "--prometheus-port", str(self.metrics_port), "--l2-adapter", json.dumps(self.adapter)],
            stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        wait_healthy(f"http://127.0.0.1:{self.http_port}/healthcheck", self.proc, self.log)

    def counters(self) -> dict:
        (adapter,) = http(f"http://127.0.0.1:{self.http_port}/status")["storage_manager"]["l2_adapters"]
        assert adapter["type"] == "KvtoolL2Adapter"
        return adapter["counters"]

    def wait_for_stored(self, at_least: int, timeout: float = 180) -> dict:
        """Counters once ``at_least`` chunks are stored, each coded as KV (as blocks of [tokens, hidden]), not as bytes."""
        deadline = time.monotonic() + timeout
        while (counters := self.counters()).get("chunks_stored|kv", 0) + counters.get("chunks_stored|blocks", 0) < at_least:
            assert "chunks_stored|bytes" not in counters, counters
            assert time.monotonic() < deadline, f"fewer than {at_least} chunks stored: {counters}"
            time.sleep(1)
        return counters

    def clear_l1(self) -> None:
        assert http(f"http://127.0.0.1:{self.http_port}/cache/clear", {"tier": "l1", "force": True})["status"] == "ok"


class VllmServer:
    def __init__(self, model: Path, lmcache: LMCacheServer, workdir: Path, env: dict) -> None:
        self.port = free_port()
        self.log = workdir / f"vllm-{free_port()}.log"
        transfer = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": lmcache.port,
                                                  "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "m",
             "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16", "--max-model-len", "2048",
             "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
             "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details", "--enable-prefix-caching",
             "--kv-transfer-config", json.dumps(transfer)],
            stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, env={**env, "VLLM_SERVER_DEV_MODE": "1"},
            cwd=ROOT, start_new_session=True)
        wait_healthy(f"http://127.0.0.1:{self.port}/health", self.proc, self.log)

    def complete(self, text: str, salt: str | None = None) -> tuple[list[int], int, int]:
        """Output token ids, the prompt's tokens, and those vLLM did not compute (its prefix cache or LMCache)."""
        body = {"model": "m", "prompt": text, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, **({"cache_salt": salt} if salt else {})}
        reply = http(f"http://127.0.0.1:{self.port}/v1/completions", body)
        details = reply["usage"].get("prompt_tokens_details") or {}
        return reply["choices"][0]["token_ids"], reply["usage"]["prompt_tokens"], details.get("cached_tokens") or 0

    def reset_prefix_cache(self) -> None:
        deadline = time.monotonic() + 60
        while not http(f"http://127.0.0.1:{self.port}/reset_prefix_cache", {}, timeout=60)["success"]:
            assert time.monotonic() < deadline, "vLLM would not reset its prefix cache"
            time.sleep(1)


def test_chunks_come_back_from_the_kvtool_tier(model, tmp_path):
    store = f"file://{tmp_path}/kvtool"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "LMCACHE_DISABLE_BANNER": "1", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "PYTHONHASHSEED": "0"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    shm, needed = shutil.disk_usage("/dev/shm").free, VLLM_SHM_BYTES + 1.25 * KV_CACHE_BYTES
    assert shm > needed, (f"/dev/shm has {shm / 2**20:.0f} MiB free, vLLM and LMCache need {needed / 2**20:.0f} MiB "
                          "there: make it larger (mount -o remount,size=1g /dev/shm, or docker run --shm-size=1g)")
    started: list[subprocess.Popen] = []
    try:
        lmcache = LMCacheServer(store, tmp_path, env)
        started.append(lmcache.proc)
        vllm = VllmServer(model, lmcache, tmp_path, env)
        started.append(vllm.proc)
        prompt = TEXT.read_text()[:5000]  # about 1,150 tokens: 4 full chunks of 256
        _, tokens, cached = vllm.complete(prompt)
        chunks = tokens // CHUNK
        assert cached == 0 and chunks >= 4
        lmcache.wait_for_stored(chunks)
        reference, _, cached = vllm.complete(prompt)  # vLLM's own prefix cache
        assert cached >= chunks * CHUNK

        vllm.reset_prefix_cache()
        lmcache.clear_l1()
        before = lmcache.counters()
        restored, _, cached = vllm.complete(prompt)
        after = lmcache.counters()
        assert restored == reference
        assert cached >= chunks * CHUNK
        assert after["chunks_loaded"] - before.get("chunks_loaded", 0) >= chunks, after  # from the kvtool tier
        assert not any(k.startswith("load_failures") for k in after), after
        assert after["stored_bytes"] * 1.3 < after["stored_raw_bytes"], after  # compressed, losslessly (same output)

        # SIGKILL: L1 is gone with the process, the file tier stays. vLLM's connector registers its KV cache
        # with the server only when vLLM starts (LMCache 0.5.6), so vLLM starts again too.
        stop(lmcache.proc)
        stop(vllm.proc)
        lmcache.start()
        started.append(lmcache.proc)
        assert lmcache.counters()["chunks_reindexed"] >= chunks
        vllm = VllmServer(model, lmcache, tmp_path, env)
        started.append(vllm.proc)
        again, _, cached = vllm.complete(prompt)
        counters = lmcache.counters()
        assert again == reference and cached >= chunks * CHUNK
        assert counters["chunks_loaded"] >= chunks, counters

        vllm.reset_prefix_cache()
        _, _, cached = vllm.complete(prompt, salt="another-tenant")
        assert cached == 0
        assert lmcache.counters()["chunks_loaded"] == counters["chunks_loaded"]
    finally:
        for proc in reversed(started):
            stop(proc)
