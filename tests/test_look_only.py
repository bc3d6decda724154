"""Commands that only look (store stats and ls, inspect, verify) change nothing on disk."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.store import open_store

def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root``: its type and, for files, size, modification time and a hash of the content.

    A directory's own size and time are left out: SQLite, which indexes a file store, creates
    its write-ahead log and shared-memory files beside the index when it opens and removes
    them when the last connection closes, so the directory's time moves with nothing changed.
    """
    out = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        if path.is_dir():
            out[str(path.relative_to(root))] = (st.st_mode,)
        else:
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
            out[str(path.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


@pytest.fixture
def workdir(tmp_path, samples) -> Path:
    """A file store holding two 5 MB entries, a .kvz and a raw cache."""
    store = tmp_path / "kvcache"
    with open_store(f"file://{store}") as s:
        for i, sample in enumerate(samples[:2]):
            assert s.put(f"session-{i}", sample.read_bytes(), {"tokens": 256})
    assert CliRunner().invoke(app, ["compress", str(samples[0]), str(tmp_path / "c.kvz"), "--chunk-tokens", "64"]).exit_code == 0
    (tmp_path / "raw.safetensors").write_bytes(samples[0].read_bytes())
    past = 1_600_000_000
    for path in tmp_path.rglob("*"):  # times in the past, so a rewrite within the same clock tick shows too
        os.utime(path, (past, past))
    os.utime(tmp_path, (past, past))
    return tmp_path


STORE = "file://{root}/kvcache"
CASES = [
    ["store", "stats", "--store", STORE],
    ["store", "stats", "--json", "--store", STORE],
    ["store", "ls", "--store", STORE],
    ["store", "ls", "--json", "--store", "memory://," + STORE],
    ["store", "stats", "--store", "memory://?capacity=1KiB," + STORE],
    ["store", "stats", "--store", STORE + "?capacity=1MiB"],  # below what it holds: only writes may evict
    ["store", "ls", "--store", STORE + "?capacity=1MiB"],
    ["inspect", "{root}/c.kvz"],
    ["inspect", "{root}/c.kvz", "--json"],
    ["inspect", "{root}/raw.safetensors", "--json"],
    ["verify", "{root}/c.kvz"],
    ["verify", "{root}/c.kvz", "--full", "--json"],
]


@pytest.mark.parametrize("args", CASES, ids=lambda args: " ".join(a.replace("{root}/", "") for a in args))
def test_looking_changes_nothing_on_disk(workdir, args):
    before = snapshot(workdir)
    result = CliRunner().invoke(app, [a.format(root=workdir) for a in args])
    assert result.exit_code == 0, result.output
    assert snapshot(workdir) == before


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("verb", [["ls"], ["stats"], ["stats", "--json"], ["get", "k"], ["evict", "k"],
                                  ["lookup", "--tokens", "1,2,3"]])
def test_a_store_that_does_not_exist_is_an_error_that_creates_nothing(tmp_path, monkeypatch, verb):
    monkeypatch.delenv("KVTOOL_STORE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    (tmp_path / "not-a-store").mkdir()
    (tmp_path / "home").mkdir()
    before = _tree(tmp_path)
    for store, named, why in (
        [f"file://{tmp_path}/typo-store", f"{tmp_path}/typo-store", "does not exist"],
        [f"memory://,file://{tmp_path}/out/deeper/store", f"{tmp_path}/out/deeper/store", "does not exist"],
        [f"file://{tmp_path}/not-a-store", f"{tmp_path}/not-a-store", "is not a file store"],
        [None, f"{tmp_path}/home/.cache/kvtool/store", "does not exist"],  # the default store, never written yet
    ):
        result = CliRunner().invoke(app, ["store", *verb, *(["--store", store] if store else [])])
        assert result.exit_code == 1, (store, result.output)
        assert result.stderr.strip() == f"kvtool: error: file store {named} {why}" + (
            " (it has no index.sqlite3)" if why == "is not a file store" else "")
        assert _tree(tmp_path) == before


def test_an_empty_listing_says_so(tmp_path):
    url = f"file://{tmp_path}/store"
    with open_store(url):
        pass  # an empty store, created by a writer
    result = CliRunner().invoke(app, ["store", "ls", "--store", url])
    assert result.exit_code == 0
    assert result.stdout == f"0 entries in file://{tmp_path}/store\n"
    with open_store(url) as s:
        s.put("a", b"x" * 2048, {"tokens": 4})
    lines = CliRunner().invoke(app, ["store", "ls", "--store", url]).stdout.splitlines()
    assert lines[0].split() == ["key", "tier", "size", "tokens"] and lines[1].split()[:2] == ["a", "file"]
    assert lines[-1].startswith(f"1 entry in file://{tmp_path}/store, ")


def test_a_put_into_memory_only_warns_that_the_entry_dies_with_the_command(tmp_path):
    result = CliRunner().invoke(app, ["store", "put", "k", "-", "--store", "memory://"], input=b"value")
    assert result.exit_code == 0
    assert "'k' is gone when the command exits" in result.stderr
    persistent = CliRunner().invoke(app, ["store", "put", "k", "-", "--store", f"memory://,file://{tmp_path}/s"],
                                    input=b"value")
    assert persistent.exit_code == 0 and "gone" not in persistent.stderr
    quiet = CliRunner().invoke(app, ["-q", "store", "put", "k", "-", "--store", "memory://"], input=b"value")
    assert quiet.exit_code == 0 and quiet.stderr == ""


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("verb", [["get", "k"], ["evict", "k"], ["put", "k", "-"], ["ls"], ["stats"]])
def test_an_unreachable_redis_is_unavailable_not_a_missing_entry(verb, tmp_path):
    url = f"redis://127.0.0.1:{_closed_port()}/0?timeout=0.5&connect_timeout=0.5"
    with open_store(f"file://{tmp_path}/s"):
        pass  # a file tier above that exists
    for store in (url, f"file://{tmp_path}/s,{url}"):
        result = CliRunner().invoke(app, ["store", *verb, "--store", store], input=b"v")
        assert result.exit_code == 3, result.output
        assert result.stderr.startswith("kvtool: error: cannot reach the redis store redis://127.0.0.1:")
        assert len(result.stderr.strip().splitlines()) == 1


def test_a_wrong_redis_password_is_unavailable(redis_server):
    import redis

    redis.Redis(port=redis_server.port).config_set("requirepass", "right-pw")
    for verb in (["get", "k"], ["evict", "k"], ["put", "k", "-"]):
        result = CliRunner().invoke(app, ["store", *verb, "--store", f"redis://:wrong-pw@127.0.0.1:{redis_server.port}/0"],
                                    input=b"v")
        assert result.exit_code == 3, result.output
        assert "wrong-pw" not in result.output and len(result.stderr.strip().splitlines()) == 1
