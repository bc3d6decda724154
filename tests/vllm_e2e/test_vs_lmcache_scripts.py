"""The LMCache comparison's scripts start in vLLM's environment, where they run (they need its aiohttp and vLLM).

    .venv-vllm/bin/python -m pytest tests/vllm_e2e/test_vs_lmcache_scripts.py

tests/test_benchmark_scripts.py imports every benchmark script, but in the main
environment these stop at their first third-party import, before kvtool's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: create its environment with scripts/vllm-env.sh")

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_lmcache"


@pytest.mark.parametrize("script", ["bench.py", "profile_restore.py", "report.py"])
def test_script_starts(script):
    result = subprocess.run([sys.executable, str(SCRIPTS / script), "--help"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.startswith("usage:"), result.stderr[-3000:]


def test_timed_connector_imports():
    result = subprocess.run([sys.executable, "-c", "import timed_connector"], cwd=SCRIPTS, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
