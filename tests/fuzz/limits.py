"""The bar every case must clear, and the sandbox fixture the fuzz tests share.

(Not a conftest.py: tests elsewhere import the top-level conftest by name.)
"""

from __future__ import annotations

import pytest

from sandbox import Sandbox

#: The bar every crafted or generated input must clear: a kvtool error or exact data,
#: within this much CPU time and this much memory beyond the reader's own.
CPU_SECONDS = 2.0
MEMORY = 256 << 20
#: What the harness lets a reader decode: enough for every valid case, far below the memory bar.
MAX_SIZE = 64 << 20


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    box = Sandbox(memory=MEMORY)
    yield box
    box.close()


def assert_bounded(report: dict) -> None:
    """The case ran to its end (no kill, no timeout, no stray exception) within the bar."""
    assert report["status"] in ("ok", "error", "cli"), report
    assert report["child_cpu_s"] <= CPU_SECONDS, report
    assert report["rss_growth"] <= MEMORY, report
