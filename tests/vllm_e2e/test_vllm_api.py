"""kvtool's API inside a real vLLM server, and vLLM's block hashes reproduced for lookups beside it.

Run inside the vLLM environment (scripts/vllm-env.sh)::

    .venv-vllm/bin/python -m pytest tests/vllm_e2e
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: create its environment with scripts/vllm-env.sh")

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvtool.server.lookup import BlockHasher  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "out" / "smollm2-135m"
PROMPT = ROOT / "samples" / "texts" / "GPL-3.txt"
RUNNER = Path(__file__).with_name("run_vllm_api.py")


# xxhash_cbor needs a fixed PYTHONHASHSEED: without one vLLM seeds it randomly in each process.
@pytest.mark.parametrize("algo, hash_seed", [("sha256_cbor", None), ("sha256_cbor", "1234"), ("xxhash_cbor", "1234")])
@pytest.mark.parametrize("salt", [None, "tenant-1"])
def test_block_hashes_match_vllm_outside_vllm(algo, salt, hash_seed, monkeypatch):
    if hash_seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", hash_seed)
    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    tokens = list(range(7, 7 + 16 * 5 + 3))
    request = Request("r", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                      block_hasher=kv_cache_utils.get_request_block_hasher(16, hash_fn))
    ours = BlockHasher(algo, **({} if hash_seed is None else {"seed": hash_seed})).hashes(tokens, 16, salt or "")
    assert ours == [bytes(h) for h in request.block_hashes] and len(ours) == 5


@pytest.fixture(scope="module")
def model() -> Path:
    if not (MODEL / "config.json").exists():
        subprocess.run([sys.executable, "-m", "kvtool", "convert-model", str(MODEL)], check=True)
    return MODEL


def test_api_inside_vllm_moves_the_live_entries(model: Path, tmp_path: Path) -> None:
    spec = {"model": str(model), "store_dir": str(tmp_path / "store"), "socket": str(tmp_path / "api.sock"),
            "prompt_file": str(PROMPT), "salt": "tenant-1"}
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "KVTOOL_API_TOKEN": secrets.token_urlsafe(32)}
    proc = subprocess.run([sys.executable, str(RUNNER), str(spec_file)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    stored = result["stored"].get("memory", 0)
    assert stored >= 1000 and result["stored"] == {"memory": stored}  # looked up by token ids and salt alone
    assert result["other_tenant"] == 0
    assert result["offloaded"] == result["keys"] and result["after_offload"] == {"file": stored}
    assert result["prefetched"] == result["keys"] and result["after_prefetch"] == {"memory": stored}
    assert result["pinned"] == result["keys"]
    restored = [(int(n), tier) for n, tier in re.findall(r"restored (\d+) tokens from (\S+) in", proc.stderr)]
    assert restored == [(stored, "memory")], proc.stderr[-4000:]
    assert not (tmp_path / "api.sock").exists()  # the API stopped with vLLM
