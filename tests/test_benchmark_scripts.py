"""The benchmark scripts import against this kvtool: a name renamed or removed in the package breaks a script
that no other test runs, and it shows only when someone reruns the benchmark."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").rglob("*.py"))
MISSING = 3  # the exit status of the probe when a third-party module is not installed here

PROBE = """
import importlib.util, sys
path = sys.argv[1]
sys.path.insert(0, path.rsplit("/", 1)[0])
spec = importlib.util.spec_from_file_location("benchmark_script", path)
module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # as an import does: dataclasses look it up
try:
    spec.loader.exec_module(module)
except ModuleNotFoundError as exc:
    if exc.name and exc.name.split(".")[0] != "kvtool":
        print(exc.name)
        sys.exit(3)
    raise
"""


def test_there_are_scripts_to_check():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_benchmark_script_imports(script):
    """Importing runs a script's imports and definitions only (each runs its work under ``__main__``)."""
    result = subprocess.run([sys.executable, "-c", PROBE, str(script)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    if result.returncode == MISSING:
        pytest.skip(f"{result.stdout.strip()} is not installed here; the script needs it")
    assert result.returncode == 0, result.stderr[-3000:]
