"""``kvtool inspect`` and ``kvtool reorder`` through the Typer app, on the real samples."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open
from typer.testing import CliRunner

from kvtool import stats
from kvtool.cache import KVCache
from kvtool.cli import app
from kvtool.layouts import registry

runner = CliRunner()
CHAINS = ["channel-major|byteplane", "channel-major|bf16-split", "xor-delta|byteplane", "channel-major|xor-delta|bf16-split"]


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def small_sample(samples, tmp_path_factory):
    """Four layers and 37 tokens of a real sample, so every layout runs quickly on odd-sized real data."""
    path = tmp_path_factory.mktemp("cache") / "small.safetensors"
    KVCache.load(samples[0], layers=[0, 1, 14, 29], tokens=slice(5, 42)).save(path)
    return path


@pytest.mark.parametrize("index", [0, -1])
def test_inspect_json_reports_the_sample(samples, index):
    result = run("inspect", samples[index], "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert (report["layers"], report["kv_heads"], report["head_dim"], report["dtype"]) == (30, 3, 64, "bf16")
    assert report["model"]["num_layers"] == 30 and report["tokens"] == 256
    assert report["bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    assert report["provenance"]["source"] == "hf"
    assert len(report["tensors"]) == 60
    first = report["tensors"][0]
    assert (first["layer"], first["kind"]) == (0, "key")
    assert first["min"] < 0 < first["max"] and 0 <= first["zeros"] <= 1
    assert first["exponent"]["min"] <= first["exponent"]["top"][0]["exponent"] <= first["exponent"]["max"]
    hi, lo = first["byte_entropy_bits"]
    assert 0 < hi < lo <= 8


def test_entropy_statistics_behind_inspect():
    assert stats.byte_entropy(bytes(range(256)) * 4) == pytest.approx(8.0)
    assert stats.byte_entropy(b"\x07" * 100) == 0.0 and stats.byte_entropy(b"") == 0.0
    assert stats.u16_entropy(np.arange(1024, dtype=np.uint16)) == pytest.approx(10.0)
    values = np.array([[[1.0, -1.0], [2.0, -1.0], [4.0, -1.0], [8.0, -1.0]]], np.float32)  # [1 head, 4 tokens, 2 dims]
    assert stats.sign_exponent_entropy_per_channel(values).tolist() == [[2.0, 0.0]]
    assert stats.byte_plane_entropies(np.full(8, 0x1234, np.uint16).view(np.float16)) == [0.0, 0.0]
    summary = stats.exponent_summary(values)
    assert (summary["min"], summary["max"], summary["top"][0]) == (0, 3, {"exponent": 0, "share": 0.625})
    assert stats.exponent_summary(np.zeros(4, np.float16))["top"] == []


def test_inspect_text(samples):
    result = run("inspect", samples[0])
    assert result.exit_code == 0, result.output
    assert "30 layers" in result.output and "bf16" in result.output and "provenance" in result.output


def test_inspect_with_a_pattern(small_sample, tmp_path):
    cache = KVCache.load(small_sample)
    tensors = {f"L{layer:02d}.{kind}": np.ascontiguousarray(a) for layer, kind, a in cache.tensors()}
    foreign = tmp_path / "foreign.safetensors"
    foreign.write_bytes(safetensors.numpy.save(tensors))
    result = run("inspect", foreign, "--json", "--pattern", "L{layer:02d}.{k|v}")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["layers"] == 4


@pytest.mark.parametrize("layout", sorted(i for i in registry.ids() if not registry.get(i).lossy) + CHAINS + [""])
def test_reorder_round_trips_bit_exactly(small_sample, tmp_path, layout):
    source = small_sample
    if layout == "fp16-split":  # the one layout that takes no bf16
        source = tmp_path / "fp16.safetensors"
        _save_as_fp16(small_sample, source)
    cache = KVCache.load(source)
    reordered, restored = tmp_path / "reordered.safetensors", tmp_path / "restored.safetensors"
    result = run("reorder", source, reordered, "--layout", layout, "--json")
    assert result.exit_code == 0, result.output
    planes = json.loads(result.output)["planes"]
    with safe_open(str(reordered), framework="numpy") as f:
        assert set(f.keys()) == {f"layer.{i}.{kv}.{p}" for i in cache.layer_ids for kv in ("key", "value") for p in planes}
        meta = f.metadata()
    assert [c["id"] for c in json.loads(meta["kvtool.layout"])] == [s for s in layout.split("|") if s]
    assert json.loads(meta["kvtool.tensors"])["layer.0.key"]["shape"] == [3, 37, 64]
    result = run("reorder", reordered, restored, "--inverse")
    assert result.exit_code == 0, result.output
    back = KVCache.load(restored)
    assert back.equal_bits(cache)
    assert (back.model, back.provenance) == (cache.model, cache.provenance)


def _save_as_fp16(src, dst):
    cache = KVCache.load(src)
    fp16 = [[a.astype(np.float16) for a in arrays] for arrays in (cache.keys, cache.values)]
    KVCache(*fp16, cache.model, cache.provenance, cache.layer_ids, cache.token_start).save(dst)


def test_reorder_keeps_plane_dtypes(small_sample, tmp_path):
    out = tmp_path / "r.safetensors"
    assert run("reorder", small_sample, out, "--layout", "bf16-split").exit_code == 0
    with safe_open(str(out), framework="numpy") as f:
        assert f.get_tensor("layer.0.key.exp").dtype == np.uint8
        assert f.get_tensor("layer.0.key.exp").shape == (3, 37, 64)
        assert f.get_tensor("layer.0.key.sign").shape == (3 * 37 * 64 // 8,)


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["--layout", "byteplane|nope"], 2, ["stage 2", "unknown layout 'nope'"]),
        (["--layout", "fp16-split"], 2, ["fp16-split", "bf16"]),
        ([], 2, ["--layout", "--inverse"]),
        (["--layout", "byteplane", "--inverse"], 2, ["--layout", "--inverse"]),
        (["--inverse"], 2, ["not a file written by"]),
    ],
)
def test_reorder_errors_are_one_line(small_sample, tmp_path, args, code, words):
    result = run("reorder", small_sample, tmp_path / "out.safetensors", *args)
    assert result.exit_code == code
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtool: error:")
    for word in words:
        assert word in lines[0]
    assert not (tmp_path / "out.safetensors").exists()


def test_reorder_inverse_rejects_a_damaged_file(small_sample, tmp_path):
    reordered = tmp_path / "r.safetensors"
    assert run("reorder", small_sample, reordered, "--layout", "byteplane").exit_code == 0
    with safe_open(str(reordered), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    tensors["layer.1.value.lo"] = tensors["layer.1.value.lo"][:, :-1]
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(safetensors.numpy.save(tensors, metadata=meta))
    result = run("reorder", damaged, tmp_path / "out.safetensors", "--inverse")
    assert result.exit_code == 4 and "layer.1.value" in result.output and "'lo'" in result.output

    del tensors["layer.1.value.lo"]
    damaged.write_bytes(safetensors.numpy.save(tensors, metadata=meta))
    result = run("reorder", damaged, tmp_path / "out.safetensors", "--inverse")
    assert result.exit_code == 4 and "missing tensors" in result.output


def test_missing_input_file(tmp_path):
    result = run("inspect", tmp_path / "nope.safetensors")
    assert result.exit_code == 2 and "no such file" in result.output
