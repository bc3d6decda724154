"""benchmarks/lmcache_l2/report.py: how restored outputs are compared with vLLM's prefix cache.

The cells' target "outputs equal to vLLM's prefix cache on every restored request" is read
from these counts; a differing request is located and, with log-probabilities recorded,
its tie told from a real difference.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "lmcache_l2" / "report.py"
_spec = importlib.util.spec_from_file_location("lmcache_l2_report", SCRIPT)
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def _request(session: int, turn: int, output: list[int], cached: int = 256, top=None) -> dict:
    row = {"session": session, "turn": turn, "output": output, "cached_tokens": cached, "stored_before": 256,
           "ttft_s": 0.5}
    if top is not None:
        row["top"] = top
    return row


def _phase(config: str, requests: list[dict]) -> dict:
    return {"config": config, "concurrency": 4, "requests": requests, "l2_loads": [], "l2_disk_bytes": 0}


def test_an_exact_tie_is_told_apart_from_a_wide_gap():
    tie = [[[7, -0.1]], [[314, -3.0], [338, -3.0], [347, -3.0]]]
    wide = [[[7, -0.1]], [[314, -0.2], [347, -4.5]]]
    assert report.divergence(_request(0, 0, [7, 347]), _request(0, 0, [7, 314], top=tie)) == \
        "session 0 turn 0 at output token 1 (0.000 nats apart)"
    assert report.divergence(_request(0, 0, [7, 347]), _request(0, 0, [7, 314], top=wide)) == \
        "session 0 turn 0 at output token 1 (4.300 nats apart)"
    assert report.divergence(_request(1, 1, [5, 6, 9]), _request(1, 1, [5, 6, 8])) == \
        "session 1 turn 1 at output token 2 (no log-probabilities recorded)"


def test_only_restored_requests_with_a_reference_are_compared():
    reference = report.reference_outputs([_phase("vllm-prefix", [_request(0, 0, [1, 2]), _request(1, 0, [3, 4])])])
    cells = report.trace_cells([_phase("kvtool", [_request(0, 0, [1, 2]), _request(1, 0, [3, 5]),
                                                  _request(2, 0, [6, 6]), _request(3, 0, [9, 9], cached=0)])],
                               reference)
    kvtool = cells[("kvtool", 4)]
    assert (kvtool["same"], kvtool["of"], kvtool["restored_of"]) == (1, 2, 3)
    assert kvtool["differ"] == ["session 1 turn 0 at output token 1 (no log-probabilities recorded)"]
    lines = report.targets("warm", {}, cells)
    assert any("NOT COMPARED on 1 of 3" in line for line in lines)


def test_a_reference_from_another_trace_is_refused(tmp_path):
    def results(cell: str, sessions: int, phases: list[dict]) -> Path:
        path = tmp_path / f"{cell}.json"
        settings = {"model": "m", "sessions": sessions, "turns": 2, "context": 1024, "output_tokens": 8, "seed": 0,
                    "budget_fraction": 0.6}
        path.write_text(json.dumps({"cell": cell, "settings": settings, "cpus": 2, "started": "t", "load": [],
                                    "trace": phases}))
        return path

    capacity = results("capacity", 8, [_phase("kvtool", [_request(0, 0, [1, 2])])])
    same = results("warm", 8, [_phase("vllm-prefix", [_request(0, 0, [1, 2])])])
    other = results("cold", 4, [_phase("vllm-prefix", [_request(0, 0, [1, 2])])])
    run = [sys.executable, str(SCRIPT), str(capacity), "--reference"]
    ok = subprocess.run([*run, str(same)], capture_output=True, text=True, check=True)
    assert "outputs = vLLM's prefix cache on every restored request: met (1 of 1)" in ok.stdout
    refused = subprocess.run([*run, str(other)], capture_output=True, text=True)
    assert refused.returncode == 2 and "sessions differ" in refused.stderr
