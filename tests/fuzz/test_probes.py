"""Every probe family at 0: no wrong data, hang, traceback, crash, memory over 512 MB, secret
printed or byte changed by a look-only command (tests/fuzz/probes.py says how each is counted).
A larger run of the same harness: benchmarks/probe_count.py."""

from __future__ import annotations

import pytest

from probes import BAD, HANG_S, run_probes
from sandbox import Sandbox


@pytest.fixture(scope="module")
def probe_sandbox():
    box = Sandbox(memory=1 << 30, cpu_seconds=int(HANG_S), timeout=HANG_S + 5)  # room to measure 512 MB, and a hang
    yield box
    box.close()


def test_every_probe_counts_zero(probe_sandbox, tmp_path):
    families, found = run_probes(probe_sandbox, tmp_path, mutations=24, seed=1)
    assert families["crafted files"]["probes"] >= 4 * 50 and families["mutated files"]["probes"] == 4 * 24
    assert all(counts["probes"] > 0 for counts in families.values()), families
    assert found == []
    assert {name: {bad: counts[bad] for bad in BAD if counts[bad]} for name, counts in families.items()} == {
        name: {} for name in families}
