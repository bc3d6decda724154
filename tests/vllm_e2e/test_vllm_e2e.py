"""End to end on vLLM's CPU build: save a long prompt's KV, restore it in a fresh process, get the same tokens.

Run inside the vLLM environment (scripts/vllm-env.sh)::

    .venv-vllm/bin/python -m pytest tests/vllm_e2e

Each scenario runs ``run_vllm.py`` in its own process (vLLM cannot be
restarted inside one), greedy decoding, vLLM's own prefix cache off. Every
run, the baseline without the connector included, uses vLLM's single-process
mode (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which a file store needs): the
multiprocessing mode's greedy tokens differ from the single-process mode's from
about the sixth token even with no connector, so only like is compared with like.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: create its environment with scripts/vllm-env.sh")

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "out" / "smollm2-135m"
PROMPT = ROOT / "samples" / "texts" / "GPL-3.txt"
SUFFIX = "\n\nIn short, this license"
RUNNER = Path(__file__).with_name("run_vllm.py")


@pytest.fixture(scope="module")
def model() -> Path:
    if not (MODEL / "config.json").exists():
        subprocess.run([sys.executable, "-m", "kvtool", "convert-model", str(MODEL)], check=True)
    return MODEL


def run_vllm(tmp_path: Path, spec: dict) -> tuple[list[dict], str]:
    spec_file = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*')))}.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(spec_file)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return results, proc.stderr


def restored_tokens(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"restored (\d+) tokens", log)]


def assert_entries_hold_the_models_kv(store_url: str, model: Path, tmp_path: Path) -> None:
    """The first stored entry holds the prompt's keys and values as the model computes them (Hugging Face
    transformers, through ``kvtool dump``), not vLLM's paged layout: its CPU kernels keep a block's keys
    column-major, which a round trip through the same kernel would never show."""
    from kvtool.cache import KVCache
    from kvtool.kvz import KvzReader
    from kvtool.store import open_store

    store = open_store(store_url)
    try:
        entries = [KvzReader.from_bytes(store.get(key)) for key in store.keys()]
        (first,) = [reader for reader in entries if reader.token_start == 0]
        stored = first.read()
    finally:
        for reader in entries:
            reader.close()
        store.close()
    text = tmp_path / "prompt.txt"
    text.write_text(PROMPT.read_text()[:5000])  # as run_vllm.py cuts it
    dumped = tmp_path / "dumped.safetensors"
    tokens = stored.keys[0].shape[1]
    subprocess.run([sys.executable, "-m", "kvtool", "-q", "dump", str(text), "--model", str(model), "-o", str(dumped),
                    "--max-tokens", str(tokens)], check=True, timeout=300)
    reference = KVCache.load(dumped)
    for kind, ours, theirs in (("keys", stored.keys, reference.keys), ("values", stored.values, reference.values)):
        for layer, (a, b) in enumerate(zip(ours, theirs)):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            error = float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))
            assert error < 0.1, f"layer {layer} {kind}: relative error {error:.3f} against the model's own"


def test_restore_gives_the_same_tokens_and_bad_entries_are_recomputed(model: Path, tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    step = {"prompt_file": str(PROMPT), "suffix": SUFFIX}

    (baseline,), _ = run_vllm(tmp_path, {"model": str(model), "store": None, "steps": [step]})

    connector = {"model": str(model), "store": f"file://{store_dir}"}
    (first,), log = run_vllm(tmp_path, {**connector, "steps": [{"prompt_file": str(PROMPT)}]})
    assert first["prompt_tokens"] >= 1000
    assert restored_tokens(log) == []
    assert len(list(store_dir.rglob("*.kve"))) >= 4
    assert_entries_hold_the_models_kv(f"file://{store_dir}", model, tmp_path)

    steps = [{**step, "salt": "another-tenant"}, step, {**step, "corrupt_dir": str(store_dir)}]
    (other_salt, hit, corrupted), log = run_vllm(tmp_path, {**connector, "steps": steps})

    restored = restored_tokens(log)
    assert len(restored) == 2, log[-4000:]  # the other tenant's request looked up nothing it could use
    assert restored[0] >= 1000  # the fresh process restored the saved prompt
    assert restored[1] == 0 and "recomputing" in log  # damaged entries were refused, vLLM recomputed
    assert other_salt["tokens"] == baseline["tokens"]
    assert hit["tokens"] == baseline["tokens"]
    assert corrupted["tokens"] == baseline["tokens"]
