"""A file store killed mid-write serves only whole, checksum-valid entries after reopening."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

from kvtool.store.file import FileStore

CAPACITY = 2 * 1024 * 1024

VALUE_SOURCE = """
import hashlib

def value(i):
    size = 20_000 + (i % 7) * 50_000
    block = hashlib.sha256(str(i).encode()).digest()
    return (block * (size // len(block) + 1))[:size]
"""

WRITER = VALUE_SOURCE + """
import sys
from kvtool.store.file import FileStore

store = FileStore(sys.argv[1], capacity=int(sys.argv[2]))
print("ready", flush=True)
i = int(sys.argv[3])
while True:
    store.put(f"k{i}", value(i))
    i += 1
"""


def _expected_value():
    namespace: dict = {}
    exec(VALUE_SOURCE, namespace)
    return namespace["value"]


def _record_bytes_on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "entries").rglob("*.kve"))


def test_killed_writer_leaves_only_valid_entries(tmp_path):
    root = tmp_path / "store"
    rng = random.Random(20240611)
    for round_ in range(6):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), str(CAPACITY), str(round_ * 100_000)],
            stdout=subprocess.PIPE,
        )
        assert writer.stdout.readline() == b"ready\n"
        try:
            writer.wait(timeout=rng.uniform(0.05, 0.6))
        except subprocess.TimeoutExpired:
            writer.send_signal(signal.SIGKILL)
        assert writer.wait(timeout=30) == -signal.SIGKILL
        # room is made before a record is written, so even a kill never leaves the directory over capacity
        assert _record_bytes_on_disk(root) <= CAPACITY

    some_record = next((root / "entries").rglob("*.kve"))
    (some_record.parent / f".{some_record.name}.x1y2z3.part").write_bytes(b"an interrupted write")

    value = _expected_value()
    with FileStore(root, capacity=CAPACITY) as store:
        keys = store.keys()
        assert keys, "the writer stored nothing before being killed"
        for key in keys:
            assert store.get(key) == value(int(key[1:]))
        assert store.used_bytes <= CAPACITY
    assert not list(root.rglob("*.part"))
    assert _record_bytes_on_disk(root) <= CAPACITY
