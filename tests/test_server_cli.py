"""``kvtool serve`` as its own process, and the ``kvtool store`` verbs that drive it with ``--api``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.server import ApiClient
from kvtool.store import PrefixKeyer, open_store

SAMPLE_BYTES = (Path(__file__).resolve().parents[1] / "samples" / "code.safetensors").read_bytes()[-200_000:]
KEYER = PrefixKeyer("HuggingFaceTB/SmolLM2-135M-Instruct", "byteplane|zstd:1", salt="t1", chunk_tokens=16)
PROMPT = list(range(500, 548))


class Served:
    """``kvtool serve`` in a child process; ``url`` from the line it prints."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
        self.env.pop("KVTOOL_API_TOKEN", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtool", "serve", *args], env=self.env,
                                     stderr=subprocess.PIPE, text=True)
        self.banner = self.proc.stderr.readline()
        match = re.search(r"kvtool API on (\S+) over", self.banner)
        assert match, self.banner + self.proc.stderr.read()
        self.url = match[1]
        self.token_file = tmp_path / "config" / "kvtool" / "api-token"

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=30)
        return err


@pytest.fixture
def served(tmp_path):
    server = Served(tmp_path, "--store", f"memory://?capacity=1MiB,file://{tmp_path}/store", "--listen", "127.0.0.1:0")
    yield server
    if server.proc.poll() is None:
        server.stop()


@pytest.fixture
def cli(served, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", served.env["XDG_CONFIG_HOME"])
    monkeypatch.delenv("KVTOOL_API_TOKEN", raising=False)
    monkeypatch.setenv("KVTOOL_API", served.url)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["store", *args])


def test_serve_creates_a_private_token_and_the_verbs_use_it(served, cli, tmp_path):
    assert served.token_file.stat().st_mode & 0o777 == 0o600
    assert str(served.token_file) in served.banner
    token = served.token_file.read_text().strip()
    keys = KEYER.keys(PROMPT)
    with ApiClient(served.url, token=token) as api:
        for i, key in enumerate(keys):
            api.put(key, SAMPLE_BYTES[i * 50_000:(i + 1) * 50_000], tokens=16)

    pinned = cli("pin", *keys[:2], "absent", "--json")
    assert pinned.exit_code == 1
    assert [r["status"] for r in json.loads(pinned.stdout)["results"]] == ["pinned", "pinned", "missing"]
    assert pinned.stderr.strip() == "kvtool: error: 1 of 3 keys not done: absent (missing)"
    offloaded = cli("offload", *keys, "--to", "file")
    assert offloaded.exit_code == 1 and offloaded.stdout.count("pinned") == 2 and offloaded.stdout.count("moved") == 1
    assert cli("unpin", *keys[:2]).exit_code == 0
    assert cli("offload", *keys[:2], "--to", "-1").exit_code == 0
    found = json.loads(cli("lookup", "--tokens", ",".join(map(str, PROMPT)), "--model", KEYER.model_id,
                           "--recipe", KEYER.recipe, "--salt", "t1", "--chunk-tokens", "16", "--json").stdout)
    assert found["stored_tokens"] == 48 and found["tokens_by_tier"] == {"file": 48} and found["keys"] == keys
    assert cli("hint", keys[0], "--returns-in", "0.2", "--prefetch-ahead", "0.2").exit_code == 0
    assert cli("prefetch", *keys[1:], "--wait").exit_code == 0
    table = cli("lookup", "--tokens", " ".join(map(str, PROMPT)), "--model", KEYER.model_id,
                "--recipe", KEYER.recipe, "--salt", "t1", "--chunk-tokens", "16").stdout
    assert table.startswith("48 of 48 tokens stored in 3 entries; 48 in memory")
    assert cli("evict", keys[2], "--api", served.url).exit_code == 0
    gone = cli("evict", keys[2], "--api", served.url)
    assert gone.exit_code == 1 and gone.stderr.strip() == f"kvtool: error: no entry {keys[2]!r} in the kvtool API at {served.url}"

    err = served.stop()  # SIGTERM: the memory tier moves down to the file tier before the process ends
    assert served.proc.returncode == 0 and "Traceback" not in err
    with open_store(f"file://{tmp_path}/store") as store:
        assert sorted(store.keys()) == sorted(keys[:2])


def test_events_verb_prints_changes(served, cli):
    token = served.token_file.read_text().strip()
    printed = {}
    reader = threading.Thread(target=lambda: printed.update(result=cli("events", "--count", "3", "--json")))
    reader.start()
    with ApiClient(served.url, token=token) as api:
        deadline = time.monotonic() + 20
        while api.stats()["api"]["event_streams"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        api.put("k", SAMPLE_BYTES[:1000])
        api.pin(["k"])
        api.offload(["k"])  # refused while pinned: no event
        api.unpin(["k"])
    reader.join(timeout=30)
    lines = [json.loads(line) for line in printed["result"].stdout.splitlines()]
    assert [(e["event"], e["data"]["key"]) for e in lines] == [("stored", "k"), ("pinned", "k"), ("unpinned", "k")]


def test_lookup_without_a_server(tmp_path):
    url = f"file://{tmp_path}/store"
    with open_store(url) as store:
        store.put_prefix(KEYER, PROMPT, [b"a" * 100, b"b" * 100])
    result = CliRunner().invoke(app, ["store", "lookup", "--store", url, "--tokens", json.dumps(PROMPT + [1]),
                                      "--model", KEYER.model_id, "--recipe", KEYER.recipe, "--salt", "t1",
                                      "--chunk-tokens", "16"])
    assert result.exit_code == 0 and result.stdout.startswith("32 of 49 tokens stored in 2 entries; 32 in file")
    bad = CliRunner().invoke(app, ["store", "lookup", "--store", url, "--tokens", "1,x", "--model", "m"])
    assert bad.exit_code == 2 and bad.stderr.startswith("kvtool: error: token ids must be integers")


@pytest.mark.parametrize("args, message", [
    (["--listen", "0.0.0.0:0"], "is not a loopback address"),
    (["--listen", "nonsense"], "write HOST:PORT"),
    (["--lookup-defaults", "{\"tokens\": [1]}"], "--lookup-defaults must be a JSON object"),
    (["--tls-cert", "cert.pem"], "TLS needs both"),
])
def test_serve_refuses_unsafe_or_wrong_settings(tmp_path, args, message):
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "kvtool", "serve", "--store", "memory://,memory://", *args],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_token_file_others_can_read_is_refused(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("a-long-enough-token-for-the-api\n")
    token_file.chmod(0o640)
    env = {k: v for k, v in os.environ.items() if k != "KVTOOL_API_TOKEN"}
    proc = subprocess.run([sys.executable, "-m", "kvtool", "serve", "--store", "memory://,memory://",
                           "--token-file", str(token_file)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "accessible by other users; chmod 600 it" in proc.stderr


def test_agent_session_example_through_the_api(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "agent_session.py"
    result = subprocess.run([sys.executable, str(example), "--serve"], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("memory -> file  offloaded by caller") == 4
    assert out.count("file -> memory  prefetched") == 4
    assert "tiers now: {'file': 256}" in out and "stored 256 of 296 tokens" in out
    assert "identical to the stored ones: True" in out
    assert out.count("evicted by caller") == 4
