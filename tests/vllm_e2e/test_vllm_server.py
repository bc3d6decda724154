"""A real vLLM server (CPU build, default multiprocessing) killed with SIGKILL, and a second one restoring from disk.

    .venv-vllm/bin/python -m pytest tests/vllm_e2e/test_vllm_server.py

Both servers run ``python -m vllm.entrypoints.openai.api_server`` exactly as
docs/VLLM.md tells a user to: scheduler and worker in separate processes,
sharing a ``memory,file`` store, vLLM's own prefix cache on. The reference for
a restored request is vLLM's own prefix cache in the same process mode and
configuration (a repeated request on the first server); the reference for a
request whose entries are damaged is the same prompt computed in full.
Greedy decoding. The test also reads kvtool's series from ``/metrics`` after
known hits, misses and damaged entries, lists the store with the CLI while a
server runs, and checks the log lines a user sees at vLLM's default level.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: create its environment with scripts/vllm-env.sh")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402  (a vLLM dependency)

from kvtool.store import open_store  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ROOT / "samples" / "texts"
SUFFIX = "\n\nIn short, this text"


def prompt(name: str, chars: int) -> str:
    """The first ``chars`` of a sample text: here 1,058 to 1,107 tokens, 8 full blocks of 128, 4 entries of 256."""
    return (TEXTS / name).read_text()[:chars] + SUFFIX


class Server:
    """One ``vllm.entrypoints.openai.api_server`` process group with the kvtool connector."""

    def __init__(self, model: Path, store: str, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.model = str(model)
        self.log = log
        transfer = {
            "kv_connector": "KvtoolConnector", "kv_connector_module_path": "kvtool.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": store},
        }
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: separate processes
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
             "--dtype", "bfloat16", "--max-model-len", "4096", "--enforce-eager", "--seed", "0",
             "--port", str(self.port), "--kv-transfer-config", json.dumps(transfer)],
            cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + 600
        while not self._healthy():
            assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}:\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, "the server did not start in 10 minutes"
            time.sleep(2)

    def _healthy(self) -> bool:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5).status == 200
        except OSError:
            return False

    def complete(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(request, timeout=600))["choices"][0]["token_ids"]

    def metrics(self) -> dict[tuple[str, str], float]:
        """kvtool's samples: ``(name, label value or "")`` -> value (vLLM's model and engine labels dropped)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30).read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("kvtool_"):
                    own = [v for k, v in sample.labels.items() if k not in ("engine", "model_name")]
                    samples[(sample.name, own[0] if own else "")] = sample.value
        return samples

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill_9(self) -> None:
        """SIGKILL to every process of the server at once, as a crash or the OOM killer would."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        deadline = time.monotonic() + 60
        while _group_alive(self.proc.pid):
            assert time.monotonic() < deadline, "processes of the killed server are still running"
            time.sleep(0.5)

    def interrupt(self) -> None:
        """Ctrl-C with vLLM's default --shutdown-timeout 0."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=120)
        finally:
            if _group_alive(self.proc.pid):
                os.killpg(self.proc.pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture
def servers():
    started: list[Server] = []
    yield started
    for server in started:
        if _group_alive(server.proc.pid):
            os.killpg(server.proc.pid, signal.SIGKILL)


def store_rows(url: str) -> list[dict]:
    """``kvtool store ls --json``, run as a user would while a server uses the store."""
    out = subprocess.run([sys.executable, "-m", "kvtool", "store", "ls", "--json", "--store", url],
                         capture_output=True, text=True, check=True, timeout=120, cwd=ROOT).stdout
    return json.loads(out)


def flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-100, 2)
        byte = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_second_server_restores_what_a_killed_one_saved(model: Path, tmp_path: Path, servers: list) -> None:
    root = tmp_path / "store"
    store = f"memory://?capacity=1GiB,file://{root}"
    kept, damaged, fresh = prompt("GPL-3.txt", 5000), prompt("PSF-LICENSE.txt", 3800), prompt("functools.py.txt", 4500)

    first = Server(model, store, tmp_path / "first.log")
    servers.append(first)
    first.complete(kept)
    reference = first.complete(kept)  # the prefix from vLLM's own cache: what a restore must equal
    computed = first.complete(damaged)  # computed in full: what a recompute after damaged entries must equal
    metrics = first.metrics()
    assert metrics[("kvtool_lookups_total", "")] == 3
    assert metrics[("kvtool_tokens_found_total", "")] == 0
    assert metrics[("kvtool_entries_saved_total", "")] == 8  # 4 entries of 256 tokens per prompt
    assert metrics[("kvtool_saved_raw_bytes_total", "")] > metrics[("kvtool_saved_bytes_total", "")] > 0

    deadline = time.monotonic() + 60  # write-behind: the entries reach the file tier within moments
    while len(rows := store_rows(f"file://{root}")) < 8:
        assert time.monotonic() < deadline, rows
        time.sleep(1)
    assert {row["tokens"] for row in rows} == {256}
    first.kill_9()
    assert "kvtool at shutdown" not in first.text()  # nothing ran after the kill: the entries were on disk before

    with open_store(f"file://{root}", read_only=True) as files:
        for key in files.keys()[4:]:  # least recently used first: the second prompt's entries were saved last
            flip_a_byte(files.path_of(key))

    second = Server(model, store, tmp_path / "second.log")
    servers.append(second)
    assert second.complete(kept) == reference
    assert second.complete(damaged) == computed
    second.complete(fresh)
    metrics = second.metrics()
    assert metrics[("kvtool_lookups_total", "")] == 3
    assert metrics[("kvtool_lookup_hits_total", "")] == 2
    assert metrics[("kvtool_tokens_found_total", "")] == 2 * 1024  # both stored prompts, in whole 128-token blocks
    assert metrics[("kvtool_tokens_restored_total", "")] == 1024
    assert metrics[("kvtool_entries_restored_total", "")] == 4
    assert metrics[("kvtool_restore_failures_total", "damaged")] == 1  # the first one; later entries not read
    assert metrics[("kvtool_restore_failures_total", "missing")] == 0
    assert metrics[("kvtool_tokens_failed_total", "")] == 1024
    assert metrics[("kvtool_store_read_bytes_total", "file")] > 0
    assert metrics[("kvtool_restore_decode_seconds_count", "")] >= 1

    deadline = time.monotonic() + 30  # vLLM logs its stats every 10 s
    while "KV Transfer metrics: lookups=" not in second.text():
        assert time.monotonic() < deadline, second.text()[-4000:]
        time.sleep(1)
    log = second.text()
    assert re.search(r"KV Transfer metrics: lookups=\d+, lookup_hits=\d+, tokens_found=\d+, tokens_restored=\d+", log)
    assert "kvtool store memory://" in log  # kvtool's INFO lines show at vLLM's default level ...
    assert "tokens found in the kvtool store" not in log  # ... but not one per request
    second.interrupt()
    log = second.text()
    assert "kvtool at shutdown (scheduler): 3 lookups, 2 hits (2048 tokens found), 1 misses" in log
    # The worker process logs its totals only if vLLM lets it shut down after the interrupt, which
    # vLLM 0.32's CPU build does not always do (its counts were checked through /metrics above);
    # where it does, they must be these.
    if "kvtool at shutdown (worker 0)" in log:
        assert "kvtool at shutdown (worker 0): 1024 tokens restored, 1 restore failures" in log
