"""A file store whose writers are killed (SIGKILL) at any point stays consistent.

Two kinds of kill: at each step of publishing a write (deterministic, by making
the writer kill itself right there), and at random moments while several
writers and a reader share the store. Afterwards every indexed entry reads back
whole and right, a re-put killed before its commit left the old value,
``collect_garbage`` removes exactly what the dead writers left, and the index
and the files agree.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvtool.store import open_store
from kvtool.store.file import FileStore

CAPACITY = 2 * 1024 * 1024

VALUE_SOURCE = """
import hashlib

def value(i):
    size = 20_000 + (i % 7) * 50_000
    block = hashlib.sha256(str(i).encode()).digest()
    return (block * (size // len(block) + 1))[:size]
"""

# Each stage names the call the writer dies in, during a re-put of "k".
KILL_AT = """
import os, signal, sys
from kvtool.store import file

store = file.FileStore(sys.argv[1])
store.put("k", b"old" * 1000)

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

stage = sys.argv[2]
if stage == "writing":  # the .part file is half written
    real_write = os.write
    os.write = lambda fd, data: (real_write(fd, bytes(data)[:1000]), die())
elif stage == "before-rename":  # the .part file is whole and synced
    os.rename = die
elif stage == "in-transaction":  # renamed, the index transaction begun
    file.FileStore._write_touches = die
elif stage == "after-commit":  # indexed, the old record not yet unlinked
    file._unlink = die
store.put("k", b"new" * 1000)
"""

WRITER = VALUE_SOURCE + """
import random, sys
from kvtool.store.file import FileStore

store = FileStore(sys.argv[1], capacity=int(sys.argv[2]))
rng = random.Random(int(sys.argv[3]))
print("ready", flush=True)
while True:
    i = rng.randrange(60)
    if rng.random() < 0.8:
        store.put(f"k{i}", value(i))
    else:
        store.delete(f"k{i}")
"""

READER = VALUE_SOURCE + """
import json, sys, time
from kvtool.store.file import FileStore

store = FileStore(sys.argv[1])
deadline = time.monotonic() + float(sys.argv[2])
reads = wrong = 0
while time.monotonic() < deadline:
    for i in range(60):
        got = store.get(f"k{i}")
        reads += 1
        wrong += got is not None and got != value(i)
print(json.dumps({"reads": reads, "wrong": wrong}))
"""


def _expected_value():
    namespace: dict = {}
    exec(VALUE_SOURCE, namespace)
    return namespace["value"]


def _files(root: Path) -> set[str]:
    return {f"{p.parent.name}/{p.name}" for p in (root / "entries").rglob("*") if p.is_file()}


def _assert_consistent(root: Path, capacity: int | None = None) -> None:
    """Index and files agree, sizes add up, and nothing is left over once garbage is collected."""
    with FileStore(root, capacity=capacity) as store:
        store.collect_garbage()
        indexed = {key: store.path_of(key) for key in store.keys()}
        assert _files(root) == {f"{p.parent.name}/{p.name}" for p in indexed.values()}
        sizes = [p.stat().st_size for p in indexed.values()]
        assert store.used_bytes == sum(sizes) and store.stats()["entries"] == len(indexed)
        if capacity is not None:
            assert store.used_bytes <= capacity


@pytest.mark.parametrize("stage, survivor", [
    ("writing", b"old"), ("before-rename", b"old"), ("in-transaction", b"old"), ("after-commit", b"new"),
])
def test_a_writer_killed_at_each_step_of_a_write(tmp_path, monkeypatch, stage, survivor):
    root = tmp_path / "store"
    writer = subprocess.run([sys.executable, "-c", KILL_AT, str(root), stage], capture_output=True, timeout=60)
    assert writer.returncode == -signal.SIGKILL, writer.stderr.decode()
    monkeypatch.setattr("kvtool.store.file.PART_GRACE_S", 0.0)  # the writer is dead: no need to wait
    with open_store(f"file://{root}", read_only=True) as store:
        assert store.keys() == ["k"]
        assert store.get("k") == survivor * 1000
    leftovers = len(_files(root)) - 1
    assert leftovers == 1  # the killed write left one file behind in every stage
    _assert_consistent(root)
    with FileStore(root) as store:
        assert store.get("k") == survivor * 1000


def test_writers_killed_at_random_never_show_a_reader_a_partial_entry(tmp_path, monkeypatch):
    root = tmp_path / "store"
    rng = random.Random(20240611)
    rounds = 5
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(root), str(rounds * 1.5)], stdout=subprocess.PIPE, text=True
    )
    for round_ in range(rounds):
        writers = [
            subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(CAPACITY), str(round_ * 10 + n)],
                             stdout=subprocess.PIPE)
            for n in range(2)
        ]
        for writer in writers:
            assert writer.stdout.readline() == b"ready\n"
        for writer in writers:
            try:
                writer.wait(timeout=rng.uniform(0.1, 0.8))
            except subprocess.TimeoutExpired:
                writer.send_signal(signal.SIGKILL)
            assert writer.wait(timeout=30) == -signal.SIGKILL
    result = json.loads(reader.communicate(timeout=120)[0])
    assert reader.returncode == 0
    assert result["reads"] > 0 and result["wrong"] == 0

    value = _expected_value()
    monkeypatch.setattr("kvtool.store.file.PART_GRACE_S", 0.0)
    with open_store(f"file://{root}", read_only=True) as store:
        keys = store.keys()
        assert keys, "the writers stored nothing before being killed"
        for key in keys:
            assert store.get(key) == value(int(key[1:]))
        assert store.used_bytes <= CAPACITY
    _assert_consistent(root, CAPACITY)
