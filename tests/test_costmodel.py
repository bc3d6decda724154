"""kvtool plan: exact byte counts, break-even behaviour, and predictions within 20% of a recorded TTFT run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool import costmodel
from kvtool.cli import app

MEASURED = Path(__file__).parent / "data" / "ttft_hf_smollm2.json"
SMOLLM2 = costmodel.ModelShape("SmolLM2-135M", layers=30, kv_heads=3, head_dim=64)
QWEN3_8B = costmodel.ModelShape("Qwen3-8B", layers=36, kv_heads=8, head_dim=128)


def test_bytes_per_token_are_exact():
    assert SMOLLM2.bytes_per_token == 23_040
    assert QWEN3_8B.bytes_per_token == 147_456
    assert costmodel.ModelShape("Qwen3-32B", 64, 8, 128).bytes_per_token == 262_144
    assert costmodel.ModelShape("fp8", 36, 8, 128, "fp8").bytes_per_token == 73_728


def test_shape_from_a_config_file(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096}))
    assert costmodel.shape_from_config(config).bytes_per_token == 147_456


def test_prefill_fit_recovers_a_quadratic():
    truth = costmodel.Prefill(0.05, 2e-3, 3e-7)
    observations = [(0, n, truth.recompute(n)) for n in (512, 1024, 4096)] + [(1024, 2048, truth.suffix(1024, 2048))]
    fitted = costmodel.Prefill.fit(observations)
    assert fitted.a == pytest.approx(truth.a, rel=1e-6)
    assert fitted.b == pytest.approx(truth.b, rel=1e-6)
    assert fitted.c == pytest.approx(truth.c, rel=1e-6)
    assert truth.suffix(1000, 1000) == pytest.approx(truth.a)


def _inputs(bandwidth=1e9, tokens_per_second=1000.0, ratio=1.3, latency=1e-4):
    return costmodel.Inputs(
        model=SMOLLM2,
        prefill=costmodel.Prefill(0.01, 1 / tokens_per_second, 1e-8),
        tiers=[costmodel.Tier("t", bandwidth, latency)],
        codecs=[costmodel.CodecCost("c", ratio, 2e9)],
        build_rate=4e9,
    )


def _break_even(**kwargs):
    inputs = _inputs(**kwargs)
    return costmodel.break_even(inputs, inputs.tiers[0], inputs.codecs[0])


def test_break_even_moves_the_right_way():
    slower_tiers = [_break_even(bandwidth=b, latency=0.01) for b in (1e9, 1e8, 3e7)]
    assert slower_tiers == sorted(slower_tiers)
    faster_prefill = [_break_even(tokens_per_second=r, latency=0.01) for r in (1e3, 1e4, 1e5)]
    assert faster_prefill == sorted(faster_prefill)
    better_codecs = [_break_even(ratio=r, bandwidth=1e8, latency=0.01) for r in (1.0, 1.5, 3.0)]
    assert better_codecs == sorted(better_codecs, reverse=True)


def test_break_even_is_the_crossing():
    inputs = _inputs(bandwidth=1e8, latency=0.01)
    tier, codec = inputs.tiers[0], inputs.codecs[0]
    n = costmodel.break_even(inputs, tier, codec)
    assert costmodel.restore_seconds(inputs, tier, codec, n) < inputs.prefill.work(n)
    assert costmodel.restore_seconds(inputs, tier, codec, n - 1) >= inputs.prefill.work(n - 1)


def test_break_even_none_when_restore_never_wins():
    assert _break_even(bandwidth=1e3) is None


def test_capacity_counts_bytes():
    inputs = _inputs(ratio=2.0)
    got = costmodel.capacity(inputs, inputs.codecs[0], context=4096, concurrency=3, retained=10)
    assert got == {"bytes_per_session_raw": 4096 * 23_040, "engine_bytes": 3 * 4096 * 23_040, "store_bytes": 10 * 4096 * 23_040 // 2}


def test_predictions_match_a_recorded_run_within_20_percent():
    measured = json.loads(MEASURED.read_text())
    checks = costmodel.validate(measured, costmodel.calibrate(measured, SMOLLM2))
    assert {c["config"] for c in checks} >= {"recompute", "memory/none", "file/none", "file/default"}
    worst = max(checks, key=lambda c: abs(c["error"]))
    assert abs(worst["error"]) <= 0.20, worst


def test_codecs_from_bench_json(tmp_path):
    report = {"files": [{"results": [
        {"recipe": "byteplane|zstd:1", "status": "ok", "ratio": 1.4, "decompress_mbps": {"1": 800.0}},
        {"recipe": "qat", "status": "unavailable", "ratio": None, "decompress_mbps": {}},
    ]}]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report))
    assert costmodel.codecs_from_bench(path) == [costmodel.CodecCost("byteplane|zstd:1", 1.4, 800e6)]


def test_cli_reports_json():
    result = CliRunner().invoke(app, [
        "plan", "--layers", "36", "--kv-heads", "8", "--head-dim", "128", "--prefill-tps", "15000",
        "--tier", "nvme:6.5:0.1", "--codec", "none:1:50", "--build-gbps", "50", "--contexts", "4096,32768", "--json",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["inputs"]["model"]["bytes_per_token"] == 147_456
    assert len(report["predictions"]) == 2 and report["break_even"][0]["tier"] == "nvme"


def test_cli_needs_a_model_shape():
    result = CliRunner().invoke(app, ["plan", "--layers", "36"])
    assert result.exit_code != 0
    assert "--kv-heads" in result.output
