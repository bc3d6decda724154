from __future__ import annotations

from pathlib import Path

import pytest

SAMPLES = Path(__file__).resolve().parents[1] / "samples"


def sample_paths() -> list[Path]:
    return sorted(SAMPLES.glob("*.safetensors"))


@pytest.fixture(scope="session")
def samples() -> list[Path]:
    paths = sample_paths()
    assert paths, f"no KV cache samples in {SAMPLES}"
    return paths
