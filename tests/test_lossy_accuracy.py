"""``kvtool bench accuracy`` on the real model: the lossless restore changes nothing, a harsh lossy one shows.

One short run (a 48-token prefix of a sample text, 16 positions, 8 greedy
tokens) of the command with every part switched on; BENCHMARKS.md has the
full-size results.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.cli.accuracy import TEXTS


def test_bench_accuracy_on_the_model(tmp_path):
    pytest.importorskip("torch", reason="running the model needs the model extra: pip install 'kvtool[model]'")
    pytest.importorskip("transformers", reason="running the model needs the model extra: pip install 'kvtool[model]'")
    plot = tmp_path / "accuracy.png"
    result = CliRunner().invoke(app, [
        "bench", "accuracy", str(TEXTS / "PSF-LICENSE.txt"), "--recipes", "exphuff int:2|zstd:3",
        "--prefix", "48", "--positions", "16", "--greedy", "8", "--layers-of", "int:2|zstd:3", "--plot", str(plot), "--json",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["settings"]["positions"] == 16 and len(report["texts"]) == 1
    lossless, lossy = report["pooled"]
    assert (lossless["recipe"], lossless["lossy"], lossy["recipe"], lossy["lossy"]) == ("exphuff", False, "int:2|zstd:3", True)
    assert lossless["top1"] == 1.0 and lossless["ppl_change_pct"] == 0.0 and lossless["kl"] == 0.0
    assert lossless["greedy_identical"] == lossless["greedy_tokens"] == 8
    assert lossy["ratio"] > 2 * lossless["ratio"]
    assert lossy["kl"] > 0 and lossy["max_abs_error"] > 0
    assert lossy["keys_only"]["kl"] > 0 and lossy["values_only"]["kl"] > 0 and lossless["keys_only"] is None
    assert [t["target"].split(" with")[0] for t in report["targets"]] == ["ratio >= 2", "ratio >= 3"]
    layers = report["layers"]
    assert sorted((r["layer"], r["kind"]) for r in layers) == [(l, k) for l in range(30) for k in "kv"]
    assert all(r["kl"] >= 0 for r in layers) and any(r["kl"] > 0 for r in layers)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
