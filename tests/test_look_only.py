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
