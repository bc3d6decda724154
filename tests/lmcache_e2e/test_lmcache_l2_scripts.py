"""benchmarks/lmcache_l2 starts in LMCache's environment, where it runs (tests/test_benchmark_scripts.py stops at aiohttp).

    .venv-lmcache/bin/python -m pytest tests/lmcache_e2e/test_lmcache_l2_scripts.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed here: create its environment with "
                                      "benchmarks/vs_lmcache/lmcache-env.sh")

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "lmcache_l2"


@pytest.mark.parametrize("script", ["bench.py", "report.py"])
def test_script_starts(script):
    result = subprocess.run([sys.executable, str(SCRIPTS / script), "--help"], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0 and result.stdout.startswith("usage:"), result.stderr[-3000:]
