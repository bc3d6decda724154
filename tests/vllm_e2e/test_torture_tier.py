"""A short run of benchmarks/torture_tier.py: kvtool's tier against vLLM's own file tier, through vLLM's manager.

    .venv-vllm/bin/python -m pytest tests/vllm_e2e/test_torture_tier.py

CI keeps a seed, so a red run is kvtool's doing, not the draw (``KVTOOL_TORTURE_SEED`` picks another, ``random``
a new one each run; ``KVTOOL_TORTURE_SEEDS`` several): seed 23 draws two workers sharing vLLM's replicated copy,
LBNHC rows cut without head_dim, and a memory tier over a file tier. The long runs and their seeds (every layout)
are in BENCHMARKS.md. No chunk may come back with a wrong byte, and wherever both tiers hold
a chunk both must hit.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: create its environment with scripts/vllm-env.sh")

TORTURE = Path(__file__).resolve().parents[2] / "benchmarks" / "torture_tier.py"
OPS = 1000


@pytest.mark.parametrize("seed", [int(s) for s in os.environ.get("KVTOOL_TORTURE_SEEDS", "23").split()])
def test_the_tier_never_returns_a_wrong_byte_and_hits_where_vllm_s_file_tier_does(seed):
    chosen = os.environ.get("KVTOOL_TORTURE_SEED")
    seed = random.randrange(100000) if chosen == "random" else int(chosen or seed)
    print(f"tier torture seed {seed} (replay: benchmarks/torture_tier.py --seed {seed} --ops {OPS})")
    run = subprocess.run([sys.executable, str(TORTURE), "--seed", str(seed), "--ops", str(OPS), "--json"],
                         capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode in (0, 1), run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps(result))
    assert result["wrong"] == 0 and result["hit_mismatch"] == 0, result
    assert result["ops"] == OPS and result["both_held"] > 100 and result["hits_mine"] > 100
    assert result["fault_damage"] + result["fault_truncate"] > 0 and result["op_restart"] > 0
