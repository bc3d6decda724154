"""``kvtool bench`` on the real samples: ratios and limits checked independently, output shapes, the plot."""

from __future__ import annotations

import csv
import io
import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtool.bench.bounds import LIMITS, entropy_limits
from kvtool.bench.plot import pareto
from kvtool.bench.peers import PEERS
from kvtool.bench.recipes import BASELINES, best_recipe, everything, quick, rans_recipe
from kvtool.bench.report import CSV_COLUMNS
from kvtool.cache import KVCache
from kvtool.cli import app
from kvtool.codecs.base import Availability
from kvtool.codecs.qat import QatCodec
from kvtool.kvz import KvzReader, encode_cache
from kvtool.recipe import DEFAULT_RECIPE

runner = CliRunner()
RECIPES = ["zstd:3", "channel-major|byteplane|zstd:1,lo=none", "channel-major|sx-split|rans:192,mant=none"]


def bench(*args: str, peers: bool = False):
    peer_flag = "--peers" if peers else "--no-peers"
    result = runner.invoke(app, ["bench", "--repeat", "1", "--threads", "2", peer_flag, *map(str, args)])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def small_sample(samples, tmp_path_factory):
    """Three layers and 40 tokens of a real sample."""
    path = tmp_path_factory.mktemp("bench") / "small.safetensors"
    KVCache.load(samples[0], layers=[0, 14, 29], tokens=slice(3, 43)).save(path)
    return path


@pytest.fixture(scope="module")
def report(small_sample):
    return json.loads(bench(small_sample, "--json", *[a for r in RECIPES for a in ("-r", r)]).stdout)


def test_ratios_match_an_independent_encoding(report, small_sample):
    cache = KVCache.load(small_sample)
    (file,) = report["files"]
    assert [r["recipe"] for r in file["results"]] == RECIPES
    for result in file["results"]:
        assert result["status"] == "ok"
        blob = encode_cache(cache, result["recipe"], chunk_tokens=256)
        assert result["stored_bytes"] == len(blob)
        assert result["ratio"] == pytest.approx(cache.nbytes / len(blob), abs=1e-4)
        for layer in cache.layer_ids:  # each layer alone, encoded on its own
            alone = cache.select(layers=[layer])
            with KvzReader.from_bytes(encode_cache(alone, result["recipe"])) as reader:
                stored = reader.sizes()["total"]["stored"]
            assert result["by_layer"][str(layer)] == pytest.approx(alone.nbytes / stored, abs=1e-4)
        with KvzReader.from_bytes(blob) as reader:  # K and V: their chunks' stored lengths, from the index
            kinds = np.array([reader.tensors[t][1] for t in reader.index["tensor"]])
            for kind, arrays in (("k", cache.keys), ("v", cache.values)):
                stored = int(reader.index["stored_len"][kinds == kind].sum())
                expected = sum(a.nbytes for a in arrays) / stored
                assert result["by_kind"][kind] == pytest.approx(expected, abs=1e-4)
    best = file["results"][2]
    assert set(best["by_plane"]) == {"sx", "mant"}
    assert best["by_plane"]["mant"] == pytest.approx(1.0, abs=1e-3)  # stored raw


def test_report_shape(report):
    assert {"cpu", "cores"} <= set(report["machine"])
    assert report["settings"] == {"threads": 2, "repeat": 1, "chunk_tokens": 256, "peers": False}
    (file,) = report["files"]
    assert file["dtype"] == "bf16" and file["tokens"] == 40 and file["layers"] == 3
    assert set(file["limits"]) == {"all", "k", "v"}
    for result in file["results"]:
        assert set(result["compress_mbps"]) == set(result["decompress_mbps"]) == {"1", "2"}
        # Speeds are measured and reported, never asserted: a stalled run on a loaded machine is still a report.
        timings = [*result["compress_mbps"].values(), *result["decompress_mbps"].values(),
                   result["compress_cpu_s_per_gb"], result["decompress_cpu_s_per_gb"]]
        assert all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in timings)


def _entropy(symbols: np.ndarray) -> float:
    _, counts = np.unique(symbols, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def _context_entropy(channel: np.ndarray) -> float:
    """H(sign, exponent, top mantissa bit | ctxans's context) of one bf16 channel, bits per value."""
    level = (channel.astype(np.int64) >> 6) & 0x1FF
    rel = level - level.sum() // len(level)
    binade = np.where((rel >= -22) & (rel <= 8), np.floor_divide(rel, 2), -4)
    context = np.clip(binade, -4, 3) * 2 + (channel >> 15)
    context = np.concatenate([[0], context[:-1]])  # the first token: binade 0, sign +
    return sum(np.mean(context == c) * _entropy((channel >> 6)[context == c]) for c in np.unique(context))


def test_limits_match_a_direct_computation(small_sample):
    cache = KVCache.load(small_sample, layers=[0, 14], tokens=slice(0, 20))
    arrays = {"k": cache.keys, "v": cache.values, "all": cache.keys + cache.values}
    got = entropy_limits(cache)
    for kind, tensors in arrays.items():
        bits = [a.view(np.uint16) for a in tensors]
        flat = np.concatenate([b.reshape(-1) for b in bits])
        n = flat.size
        sign_exp = mantissa = level = in_context = 0.0
        for b in bits:
            for head in range(b.shape[0]):
                for dim in range(b.shape[2]):
                    channel = b[head, :, dim]
                    sign_exp += _entropy(channel >> 7) * len(channel)
                    mantissa += _entropy(channel & 0x7F) * len(channel)
                    level += _entropy(channel >> 6) * len(channel)
                    in_context += _context_entropy(channel) * len(channel)
        expected = {
            "values": 16 / _entropy(flat),
            "byte_planes": 16 / (_entropy(flat >> 8) + _entropy(flat & 0xFF)),
            "sign_exp_per_channel": 16 * n / (sign_exp + 7 * n),
            "fields_per_channel": 16 * n / (sign_exp + mantissa),
            "sign_level_per_channel": 16 * n / (level + 6 * n),
            "sign_level_context": 16 * n / (in_context + 6 * n),
        }
        for name in LIMITS:
            assert got[kind][name] == pytest.approx(expected[name], abs=2e-4), (kind, name)


def test_peers_run_on_the_same_blocks(small_sample):
    """Other tools follow the recipes: memcpy stores as much as it is given, lz4 and zstd round-trip."""
    (file,) = json.loads(bench(small_sample, "--json", "-r", "zstd:3", peers=True).stdout)["files"]
    peers = {r["recipe"]: r for r in file["results"][1:]}
    assert list(peers) == [f"peer: {p.name}" for p in PEERS]
    assert peers["peer: memcpy"]["ratio"] == 1.0 and peers["peer: memcpy"]["stored_bytes"] == file["raw_bytes"]
    for name in ("peer: lz4 frame", "peer: zstd:3 frame"):
        assert peers[name]["status"] == "ok" and peers[name]["ratio"] > 1.0
    for result in peers.values():
        assert result["status"] == "ok" or "not installed" in result["reason"]


def test_a_missing_peer_is_a_row_naming_its_install_line(small_sample, monkeypatch):
    """A peer not installed, or installed without what it imports (zipnn without torch), is
    reported with the command that brings it; the benchmark still measures everything else."""
    from kvtool.bench import peers as peer_tools

    def needs_torch(dtype, itemsize):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    fake = (
        peer_tools.Peer("absent", "no_such_module_for_kvtool", peer_tools._memcpy, install="pip install absent"),
        peer_tools.Peer("half installed", "json", needs_torch, install="pip install 'kvtool[zipnn]'"),
    )
    monkeypatch.setattr(peer_tools, "PEERS", (peer_tools.PEERS[0], *fake))
    (file,) = json.loads(bench(small_sample, "--json", "-r", "zstd:3", peers=True).stdout)["files"]
    absent, half = file["results"][2:]
    assert (absent["status"], half["status"]) == ("unavailable", "unavailable")
    assert absent["reason"] == "no_such_module_for_kvtool is not installed (pip install absent)"
    assert "cannot import torch" in half["reason"] and "pip install 'kvtool[zipnn]'" in half["reason"]
    table = bench(small_sample, "-r", "zstd:3", peers=True).stdout
    assert "unavailable: json is not installed: it cannot import torch (pip install 'kvtool[zipnn]')" in table


def test_the_zipnn_peer_names_an_install_that_pulls_cpu_torch():
    (zipnn,) = [p for p in PEERS if p.module == "zipnn"]
    assert "download.pytorch.org/whl/cpu" in zipnn.install and "kvtool[zipnn]" in zipnn.install


def test_the_bench_extra_pulls_no_torch():
    """The quick start installs the bench and isal extras: nothing in them may need torch (zipnn does)."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    extras = {m[1]: re.findall(r'"([A-Za-z0-9_.-]+)', m[2]) for m in re.finditer(r"(?m)^(\w+) = \[(.*)\]$", text)}
    assert extras["bench"] and extras["isal"] and extras["zipnn"] == ["zipnn"]
    assert not {"torch", "zipnn"} & set(extras["bench"] + extras["isal"])


def test_table_columns_keep_their_decimals():
    """A speed that crosses 10 or 1000 does not change how many decimals its column shows."""
    from kvtool.bench.report import column_decimals
    from kvtool.cli._common import format_table

    rows = [{"recipe": "a", "comp MB/s": 9.5}, {"recipe": "b", "comp MB/s": 1234.5}]
    lines = format_table(rows, ["recipe", "comp MB/s"], decimals=column_decimals(2)).splitlines()[1:]
    assert [line.split() for line in lines] == [["a", "9.5"], ["b", "1234.5"]]


def test_csv_has_one_row_per_file_and_recipe(small_sample):
    out = bench(small_sample, small_sample, "--csv", "-r", "zstd:3 lz4").stdout
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == CSV_COLUMNS
    assert [r["recipe"] for r in rows] == ["zstd:3", "lz4"] * 2
    assert all(r["status"] == "ok" and float(r["ratio"]) > 0.9 for r in rows)


def test_plot_is_a_png(small_sample, tmp_path):
    out = tmp_path / "pareto.png"
    bench(small_sample, "-r", "zstd:3 lz4 byteplane|zstd:1", "--plot", out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unavailable_and_unfitting_recipes_are_reported(small_sample, monkeypatch):
    monkeypatch.setattr(QatCodec, "available", classmethod(lambda cls: Availability(False, reason="no libqatzip here")))
    result = bench(small_sample, "--json", "-r", "qat", "-r", "channel-major|fp16-split|zstd:1")
    qat, fp16 = json.loads(result.stdout)["files"][0]["results"]
    assert (qat["status"], qat["reason"]) == ("unavailable", "qat: no libqatzip here")
    assert fp16["status"] == "not applicable" and "fp16" in fp16["reason"]
    table = bench(small_sample, "-r", "qat")
    assert "unavailable: qat: no libqatzip here" in table.stdout


def test_a_misspelt_recipe_fails_before_measuring(small_sample):
    result = runner.invoke(app, ["bench", str(small_sample), "-r", "zstd:3 chanel-major|zstd:1"])
    assert result.exit_code == 2
    assert "chanel-major" in result.output


def test_default_run_uses_the_samples_and_the_quick_set(samples):
    report = json.loads(bench("--json").stdout)
    assert [f["path"] for f in report["files"]] == [str(p) for p in samples]
    for file, path in zip(report["files"], samples):
        cache = KVCache.load(path)
        assert [r["recipe"] for r in file["results"]] == quick(cache)
        assert {r["status"] for r in file["results"]} <= {"ok", "unavailable"}
        ok = {r["recipe"]: r for r in file["results"] if r["status"] == "ok"}
        assert {"zstd:3", "lz4", DEFAULT_RECIPE, rans_recipe(cache), best_recipe(cache)} <= set(ok)
        assert ok[best_recipe(cache)]["ratio"] > ok[rans_recipe(cache)]["ratio"] > ok["zstd:3"]["ratio"]
        assert ok[best_recipe(cache)]["ratio"] > ok[DEFAULT_RECIPE]["ratio"]


def test_recipe_sets(samples):
    cache = KVCache.load(samples[0])
    assert quick(cache)[: len(BASELINES)] == list(BASELINES)
    assert rans_recipe(cache) == "channel-major|sx-split|rans:192,mant=none"
    assert best_recipe(cache) == "ctxans" and best_recipe(cache) in quick(cache)
    full = everything(cache)
    assert len(full) == len(set(full))
    assert "channel-major|bf16-split|zstd:19,mant=none" in full
    assert not any("fp16-split" in r for r in full)  # does not fit bf16
    assert all(("rans" in r) == ("sx-split" in r) for r in full)


def test_pareto_front():
    points = [(100, 1.2), (50, 1.5), (200, 1.0), (60, 1.1), (100, 1.3)]
    assert pareto(points) == [(200, 1.0), (100, 1.3), (50, 1.5)]
