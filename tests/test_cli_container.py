"""compress / decompress / verify / inspect of .kvz files through the CLI, on the real samples."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cache import KVCache
from kvtool.cli import app
from kvtool.codecs import registry as codec_registry
from kvtool.recipe import recipe_for
from kvtool.testing import require_available

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
GOLDEN = Path(__file__).parent / "golden"

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("codec_id", sorted(codec_registry.ids()))
def test_each_sample_round_trips_with_every_codec(samples, tmp_path, codec_id):
    require_available(recipe_for(codec_id))
    for sample in samples:
        kvz, back = tmp_path / f"{sample.stem}.kvz", tmp_path / f"{sample.stem}.safetensors"
        assert run("compress", sample, kvz, "--recipe", recipe_for(codec_id)).exit_code == 0
        result = run("verify", kvz, "--full", "--json")
        assert result.exit_code == 0 and json.loads(result.stdout)["ok"]
        assert run("decompress", kvz, back).exit_code == 0
        assert KVCache.load(back).equal_bits(KVCache.load(sample))


def test_one_byte_change_fails_with_one_line(samples, tmp_path):
    kvz = tmp_path / "c.kvz"
    run("compress", samples[0], kvz)
    data = bytearray(kvz.read_bytes())
    for pos in (3, 20, len(data) // 2, len(data) - 70, len(data) - 1):
        broken = tmp_path / f"broken{pos}.kvz"
        corrupt = bytearray(data)
        corrupt[pos] ^= 0x10
        broken.write_bytes(corrupt)
        for cmd in (["verify", broken, "--full"], ["decompress", broken, tmp_path / "out.safetensors"]):
            result = run(*cmd)
            assert result.exit_code == 4, result.output
            assert result.output.count("\n") == 1 and result.output.startswith("kvtool: error: ")
    assert not (tmp_path / "out.safetensors").exists()


def test_partial_decompress(samples, tmp_path):
    kvz, part = tmp_path / "c.kvz", tmp_path / "part.safetensors"
    run("compress", samples[1], kvz, "--chunk-tokens", "64")
    assert run("decompress", kvz, part, "--layers", "7,9-10", "--tokens", "0:128").exit_code == 0
    expected = KVCache.load(samples[1], layers=[7, 9, 10], tokens=slice(0, 128))
    assert KVCache.load(part).equal_bits(expected)


def test_inspect_kvz_reports_ratios(samples, tmp_path):
    kvz = tmp_path / "c.kvz"
    run("compress", samples[0], kvz, "--recipe", "channel-major|bf16-split|zstd:1,mant=none")
    report = json.loads(run("inspect", kvz, "--json").stdout)
    assert report["recipe"] == "channel-major|bf16-split|zstd:1,mant=none"
    assert report["layers"] == 30 and report["kv_heads"] == 3 and report["head_dim"] == 64
    sizes = report["sizes"]
    assert sizes["total"]["raw"] == KVCache.load(samples[0]).nbytes
    assert sizes["total"]["stored"] == sum(v["stored"] for v in sizes["by_plane"].values())
    assert sizes["by_plane"]["mant"]["ratio"] == 1.0 and sizes["by_plane"]["exp"]["ratio"] > 2
    assert set(sizes["by_kind"]) == {"k", "v"} and len(sizes["by_layer"]) == 30


def test_user_errors_are_one_line(samples, tmp_path):
    cases = [
        (["compress", tmp_path / "missing", tmp_path / "o"], 2, "no such file"),
        (["compress", samples[0], tmp_path / "o.kvz", "--recipe", "byteplane|nope"], 2, "not a codec"),
        (["compress", samples[0], tmp_path / "o.kvz", "--recipe", "byteplane|zstd:1", "--codec", "lz4"], 2, "not both"),
        (["decompress", samples[0], tmp_path / "o", "--tokens", "5"], 2, "apply only to .kvz"),
        (["verify", samples[0]], 4, "not a .kvz"),
    ]
    for args, code, message in cases:
        result = run(*args)
        assert result.exit_code == code, (args, result.output)
        assert message in result.output and result.output.count("\n") == 1


def test_plain_files_still_use_one_codec_stream(tmp_path):
    src, packed, back = tmp_path / "notes.txt", tmp_path / "notes.zst", tmp_path / "back.txt"
    src.write_bytes(b"plain bytes, not a KV cache\n" * 100)
    assert run("compress", src, packed).exit_code == 0
    assert packed.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"
    assert run("decompress", packed, back).exit_code == 0
    assert back.read_bytes() == src.read_bytes()


def test_qat_kvz_decodes_without_libqatzip(tmp_path):
    """The golden file written through QATzip, decoded where no libqatzip can be loaded."""
    kvz, back = GOLDEN / "v1-codec-qat.kvz", tmp_path / "q.safetensors"
    env = {**os.environ, "KVTOOL_QATZIP_LIB": str(tmp_path / "no-libqatzip.so")}
    script = (
        "import sys; from kvtool.codecs.qat import QatCodec; from kvtool.cli import main;"
        "assert not QatCodec.available().ok; sys.argv = ['kvtool', 'decompress', sys.argv[1], sys.argv[2]]; main()"
    )
    subprocess.run([sys.executable, "-c", script, str(kvz), str(back)], env=env, check=True)
    assert KVCache.load(back).equal_bits(KVCache.load(SAMPLES / "code.safetensors", layers=[0, 29], tokens=slice(0, 12)))
