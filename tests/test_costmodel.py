"""kvtool plan: exact byte counts, break-even behaviour, and predictions within 20% of a recorded TTFT run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool import costmodel, model_shape
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
    assert model_shape.shape_from_config(config).bytes_per_token == 147_456


#: Published configs, the KV parts: DeepSeek-V3 (MLA), Gemma 3 4B (sliding windows), Qwen3-Next-80B (linear attention),
#: Mistral-7B-v0.1 (a window on every layer), Qwen3-8B (a window it does not use), a Nemotron-H pattern (Mamba-2).
GEMMA3_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 5 + ["sliding_attention"] * 4
FAMILY_CONFIGS = {
    "deepseek-v3": ({"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                     "hidden_size": 7168}, 61 * 576 * 2, 61 * 576 * 2 * 32768),
    "gemma3": ({"num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                "sliding_window": 1024, "layer_types": GEMMA3_TYPES}, 34 * 4096, (5 * 32768 + 29 * 1024) * 4096),
    "gemma3-pattern": ({"num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                        "sliding_window": 1024, "sliding_window_pattern": 6}, 34 * 4096, (5 * 32768 + 29 * 1024) * 4096),
    "qwen3-next": ({"num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12}, 12 * 2048, 12 * 2048 * 32768),
    "mistral": ({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
                 "sliding_window": 4096}, 32 * 4096, 32 * 4096 * 4096),
    "qwen3": ({"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
               "sliding_window": 4096, "use_sliding_window": False}, 147_456, 147_456 * 32768),
    "nemotron-h": ({"num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "hybrid_override_pattern": "M-M*-M"}, 4096, 4096 * 32768),
}


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_a_config_gives_its_families_kv_bytes(tmp_path, family):
    config, per_token, engine = FAMILY_CONFIGS[family]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    shape = model_shape.shape_from_config(path)
    assert shape.bytes_per_token == per_token  # what a stored prompt holds per token: every KV layer's
    assert shape.engine_bytes(32768) == engine  # what the engine holds for one 32768-token sequence


def test_plan_takes_a_config_and_says_what_its_layers_keep(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(FAMILY_CONFIGS["gemma3"][0]))
    out = plan("--config", path, "--prefill-tps", 1e4, "--tier", "disk:1", "--codec", "raw:1:5", "--build-gbps", 5,
               "--contexts", "32768", "--concurrency", 1, "--retained", 1, "--json")
    report = json.loads(out.stdout)
    assert report["inputs"]["model"]["bytes_per_token"] == 34 * 4096
    assert report["capacity"][0]["engine_bytes"] == (5 * 32768 + 29 * 1024) * 4096
    assert report["capacity"][0]["store_bytes"] == 34 * 4096 * 32768
    text = plan("--config", path, "--prefill-tps", 1e4, "--tier", "disk:1", "--codec", "raw:1:5", "--build-gbps", 5).stdout
    assert "34 layers x 4 KV heads x 256 dims x K,V x 2 bytes; 29 of them keep a 1024-token window in the engine" in text
    path.write_text(json.dumps({**FAMILY_CONFIGS["gemma3"][0], "layer_types": ["sliding_attention", "moon_attention"]}))
    refused = plan("--config", path, "--prefill-tps", 1e4)
    assert refused.exit_code != 0 and "moon_attention" in refused.stderr


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


def plan(*args):
    return CliRunner().invoke(app, ["plan", *map(str, args)])


QWEN3_8B_ARGS = ["--layers", "36", "--kv-heads", "8", "--head-dim", "128"]


def test_a_plan_without_hardware_asks_for_it():
    result = plan(*QWEN3_8B_ARGS, "--name", "Qwen3-8B")
    assert result.exit_code == 2
    assert "--hardware (dev-vm, h800; docs/PLAN.md)" in result.stderr and "--build-gbps" in result.stderr
    only_some = plan(*QWEN3_8B_ARGS, "--prefill-tps", "15000", "--tier", "nvme:6.5")
    assert only_some.exit_code == 2 and "--codec or --bench-json, --build-gbps" in only_some.stderr
    assert "--prefill" not in only_some.stderr.split("or")[-1]


def test_a_preset_lends_its_prefill_only_to_its_own_models():
    """The 2-core VM's prefill was measured on SmolLM2: Qwen3-8B on that preset needs its own."""
    refused = plan(*QWEN3_8B_ARGS, "--name", "Qwen3-8B", "--hardware", "dev-vm")
    assert refused.exit_code == 2
    assert "dev-vm has a prefill only for SmolLM2-135M, not 'Qwen3-8B'" in refused.stderr
    own = json.loads(plan(*QWEN3_8B_ARGS, "--name", "Qwen3-8B", "--hardware", "dev-vm", "--prefill-tps", "15000",
                          "--json").stdout)
    assert own["inputs"]["prefill"] == {"a": 0.0, "b": 1 / 15000, "c": 0.0}
    assert own["inputs"]["sources"]["prefill"] == "--prefill-tps"
    assert own["inputs"]["sources"]["tiers"] == "--hardware dev-vm"
    smol = json.loads(plan("--layers", 30, "--kv-heads", 3, "--head-dim", 64, "--name", "HuggingFaceTB/SmolLM2-135M-Instruct",
                           "--hardware", "dev-vm", "--json").stdout)
    assert smol["inputs"]["prefill"] == {"a": 0.110, "b": 2.66e-3, "c": 1.18e-7}
    qwen = json.loads(plan(*QWEN3_8B_ARGS, "--name", "Qwen3-8B", "--hardware", "h800", "--json").stdout)
    assert qwen["inputs"]["prefill"]["b"] == 6.67e-5 and qwen["inputs"]["build_rate"] == 50e9
    assert plan(*QWEN3_8B_ARGS, "--hardware", "a100").stderr.startswith("kvtool: error: unknown --hardware 'a100'")


def test_a_measured_run_lends_its_prefill_only_to_its_model():
    refused = plan(*QWEN3_8B_ARGS, "--name", "Qwen3-8B", "--calibrate", MEASURED)
    assert refused.exit_code == 2 and "measured 'SmolLM2-135M-Instruct.Q4_1', not 'Qwen3-8B'" in refused.stderr
    same = plan("--layers", 30, "--kv-heads", 3, "--head-dim", 64, "--name", "SmolLM2-135M", "--calibrate", MEASURED, "--json")
    assert same.exit_code == 0
    assert json.loads(same.stdout)["inputs"]["sources"]["prefill"] == "measured in the kvtool bench ttft run given"


def test_the_report_prints_its_inputs_first_and_says_never():
    text = plan(*QWEN3_8B_ARGS, "--prefill-tps", "1e9", "--tier", "slow:1:5", "--codec", "none:1:1",
                "--build-gbps", "1", "--contexts", "1024").stdout
    lines = text.splitlines()
    assert lines[0] == "kvtool plan for model: model output (kvtool plan), not a measurement. Inputs:"
    assert [line.split()[0] for line in lines[1:6]] == ["model", "prefill", "tiers", "codecs", "build"]
    assert lines[3].endswith("[--tier]") and lines[2].endswith("[--prefill-tps]")
    table = lines[lines.index(next(line for line in lines if line.startswith("Break-even"))) + 1:][:2]
    assert table[1].split() == ["slow", "never"]


def test_a_config_file_names_the_report_after_its_model(tmp_path):
    config = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
              "hidden_size": 4096, "architectures": ["Qwen3ForCausalLM"]}
    plain = tmp_path / "DIR" / "config.json"
    cached = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "0123abc" / "config.json"
    for path in (plain, cached):
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(config))
    args = ["--hardware", "h800", "--contexts", "1024"]
    assert plan("--model-config", plain, *args, "--prefill-tps", 1e4).stdout.startswith("kvtool plan for Qwen3ForCausalLM:")
    assert plan("--model-config", cached, *args).stdout.startswith("kvtool plan for Qwen/Qwen3-8B:")  # the h800 fit
    assert model_shape.shape_from_config(plain).name == "Qwen3ForCausalLM"


def test_plan_help_points_to_its_documentation():
    assert "docs/PLAN.md" in " ".join(CliRunner().invoke(app, ["plan", "--help"], env={"COLUMNS": "200"}).stdout.split())


# Restore costs measured on the 2-core development VM (BENCHMARKS.md, "kvtool where offload is deployed"):
# one core decoding a 5.9 MB SmolLM2 chunk from bytes in memory, exphuff at 1.50x and the `none` recipe
# (container, checksums, copy); the page cache and the disk as read there; network links at line rate.
EXPHUFF = costmodel.CodecCost("exphuff", 1.50, 1.85e9)
NONE = costmodel.CodecCost("none", 1.0, 4.2e9)
PAGE_CACHE = costmodel.Tier("page-cache", 16.8e9)
DISK = costmodel.Tier("disk", 2.5e9)
LINK_10G = costmodel.Tier("10GbE", 1.25e9)
LINK_1G = costmodel.Tier("1GbE", 0.125e9)


def test_a_slow_link_makes_compression_pay_and_a_warm_cache_does_not():
    assert costmodel.pays(LINK_1G, EXPHUFF, NONE, decode_cores=1)["pays"]
    warm = costmodel.pays(PAGE_CACHE, EXPHUFF, NONE, decode_cores=2)
    assert not warm["pays"] and warm["saving"] < 0
    assert warm["seconds_per_gb"] > warm["baseline_seconds_per_gb"]


def test_more_free_cores_make_compression_pay_on_faster_tiers():
    below = [costmodel.pays(LINK_10G, EXPHUFF, NONE, n)["pays_below"] for n in (1, 2, 4, 8)]
    assert below == sorted(below)
    assert below[0] < LINK_10G.bandwidth < below[1]
    assert [costmodel.pays(LINK_10G, EXPHUFF, NONE, n)["pays"] for n in (1, 2)] == [False, True]


def test_pays_below_is_the_tier_speed_where_both_restores_take_as_long():
    cores = 2
    speed = costmodel.pays(DISK, EXPHUFF, NONE, cores)["pays_below"]
    at = costmodel.Tier("at", speed)
    assert costmodel.seconds_per_raw_byte(at, EXPHUFF, cores) == pytest.approx(costmodel.seconds_per_raw_byte(at, NONE, cores))
    assert costmodel.pays(costmodel.Tier("slower", speed * 0.99), EXPHUFF, NONE, cores)["pays"]
    assert not costmodel.pays(costmodel.Tier("faster", speed * 1.01), EXPHUFF, NONE, cores)["pays"]


def test_against_raw_bytes_a_codec_pays_below_the_speed_its_saved_bytes_are_worth():
    """Against a store that reads raw bytes into place with no decode step (LMCache's fs adapter)."""
    assert costmodel.baseline_codec([EXPHUFF]) is costmodel.RAW
    assert costmodel.baseline_codec([EXPHUFF, NONE]) is NONE
    row = costmodel.pays(DISK, EXPHUFF, costmodel.RAW, decode_cores=1)
    assert row["pays_below"] == pytest.approx((1 - 1 / 1.5) * 1.85e9)
    assert not row["pays"]


def test_a_codec_that_saves_nothing_never_pays_and_one_that_decodes_faster_always_does():
    copy = costmodel.CodecCost("copy", 1.0, 1e9)
    assert costmodel.pays(LINK_1G, copy, NONE, 1)["pays_below"] == 0.0
    assert not costmodel.pays(LINK_1G, copy, NONE, 1)["pays"]
    fast = costmodel.CodecCost("fast", 1.2, 8e9)
    assert costmodel.pays(PAGE_CACHE, fast, NONE, 1)["pays_below"] is None
    assert costmodel.pays(PAGE_CACHE, fast, NONE, 1)["pays"]


def test_cores_free_for_decoding_shorten_the_predicted_restore():
    inputs = costmodel.Inputs(model=SMOLLM2, prefill=costmodel.Prefill(0.0, 1e-3), tiers=[DISK], codecs=[EXPHUFF],
                              build_rate=10e9)
    one, four = (costmodel.restore_seconds(replace(inputs, decode_cores=n), DISK, EXPHUFF, 4096) for n in (1, 4))
    decode = 4096 * SMOLLM2.bytes_per_token / EXPHUFF.decode_rate
    assert one - four == pytest.approx(decode * 3 / 4)


def test_the_plan_says_where_compression_pays():
    args = ["--layers", 30, "--kv-heads", 3, "--head-dim", 64, "--prefill-tps", 300, "--tier", "page-cache:16.8",
            "--tier", "1GbE:0.125", "--codec", "none:1:4.2", "--codec", "exphuff:1.5:1.85", "--build-gbps", 10,
            "--contexts", 1024, "--decode-cores", 2]
    report = json.loads(plan(*args, "--json").stdout)
    assert report["inputs"]["decode_cores"] == 2
    assert [(r["tier"], r["codec"], r["baseline"], r["pays"]) for r in report["pays"]] == [
        ("page-cache", "exphuff", "none", False), ("1GbE", "exphuff", "none", True)]
    lines = plan(*args).stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Does compression pay?"))
    assert "decode on 2 cores" in lines[start]
    assert lines[start + 2].split()[:3] == ["page-cache", "16.8", "exphuff"] and " no " in lines[start + 2]
    assert lines[start + 3].split()[:3] == ["1GbE", "0.125", "exphuff"] and " yes " in lines[start + 3]
