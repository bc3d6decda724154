"""The model matrix under LMCache: kvtool's L2 adapter below ``lmcache server``, vLLM's CPU build with ``LMCacheMPConnector``.

    .venv-lmcache/bin/python -m pytest tests/lmcache_e2e/test_lmcache_matrix.py

``run_lmcache_matrix.py`` runs each family of ``FAMILIES`` (tests/vllm_e2e/families.py: tiny
configs, vLLM's dummy weights, SmolLM2's tokenizer): computed, asked again (vLLM's prefix
cache), then with vLLM's prefix cache and LMCache's memory emptied, so that LMCache must load
the chunks from kvtool's store, then so under another ``cache_salt``. A family is

- ``exact``: chunks came from kvtool's store and the output is vLLM's own, tokens and
  log-probabilities to the last bit; another salt loaded nothing;
- ``host wrong``: LMCache's connector gives other tokens than vLLM computes before kvtool
  serves anything (from its own memory), so no L2 below it can make them right: on vLLM's CPU
  MLA backend, which computes no prompt over cached tokens, LMCache still loads (vLLM turns its
  own prefix caching off there). kvtool's adapter cannot see the engine; the row documents it.

LMCache's connector does not take part in vLLM's hybrid KV cache allocation, so vLLM turns it
off: Gemma 3's sliding-window layers then keep every block, as full attention. Each family
starts a vLLM engine in its own process (about a minute and a half on two shared cores), so
the families are the distinct chunk layouts: grouped-query KV, sliding windows (Gemma 3, all
blocks kept; Mistral, windowed), fp8, MLA. Qwen3, Qwen3-MoE and Nemotron-H are not run here:
the first two chunk like Llama; a Mamba or linear-attention hybrid needs an LMCache chunk of a
whole hybrid block (640 tokens for Qwen3-Next) and LMCache restores no state (docs/LMCACHE.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed here: benchmarks/vs_lmcache/lmcache-env.sh")
pytest.importorskip("vllm", reason="vLLM is not installed beside LMCache here: benchmarks/vs_lmcache/lmcache-env.sh")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "vllm_e2e"))

from families import FAMILIES

RUNNER = Path(__file__).with_name("run_lmcache_matrix.py")
EXPECT = {"llama": "exact", "gemma3": "exact", "mistral": "exact", "llama-fp8": "exact", "deepseek-v2": "host wrong"}
#: What vLLM's message queues and LMCache's copy of vLLM's KV cache (96 MiB) need in /dev/shm.
SHM_BYTES = 600 * 2**20


def same(a: dict, b: dict) -> bool:
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


def verdict(row: dict) -> tuple[str, str]:
    if "error" in row:
        return "not runnable", row["error"]
    cold, warm, restored, salted = row["cold"], row["warm"], row["restored"], row["salted"]
    if salted["chunks_loaded"] or not same(salted, cold):
        return "wrong", f"another cache_salt loaded {salted['chunks_loaded']} chunks or changed the output"
    if not same(warm, cold):
        return "host wrong", (f"LMCache's connector, from its own memory ({warm['vllm_cached']} tokens), gives "
                              f"{warm['tokens'][:3]}..., vLLM computes {cold['tokens'][:3]}...")
    if not restored["chunks_loaded"]:
        return "failed", "nothing came from kvtool's store"
    if not same(restored, warm):
        return "wrong", f"restored {restored['tokens']} vs {warm['tokens']}"
    return "exact", f"{restored['chunks_loaded']} chunks ({restored['vllm_cached']} tokens) from kvtool's store"


@pytest.fixture(scope="module")
def matrix(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    assert shutil.disk_usage("/dev/shm").free > SHM_BYTES, "/dev/shm is too small for vLLM and LMCache (docs/LMCACHE.md)"
    root = tmp_path_factory.mktemp("lmcache-matrix")
    families = [f for f in FAMILIES if f.name in EXPECT]
    for family in families:
        family.write(root / "models", model)
    spec = root / "spec.json"
    spec.write_text(json.dumps({"models": str(root / "models"), "store": f"file://{root / 'store'}",
                                "families": [f.name for f in families]}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "LMCACHE_DISABLE_BANNER": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "PYTHONHASHSEED": "0"}
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):  # its own processes, its own KV size
        env.pop(name, None)
    proc = subprocess.run([sys.executable, str(RUNNER), str(spec)], capture_output=True, text=True, env=env,
                          timeout=1500, check=False)
    rows = {r["family"]: verdict(r) for r in (json.loads(line[len("FAMILY "):]) for line in proc.stdout.splitlines()
                                              if line.startswith("FAMILY "))}
    assert proc.returncode == 0 and set(rows) == set(EXPECT), proc.stderr[-4000:]
    return rows


@pytest.mark.parametrize("name", list(EXPECT))
def test_each_family_under_lmcache_is_exact_or_documented(matrix: dict, name: str) -> None:
    status, reason = matrix[name]
    assert status == EXPECT[name], reason
