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
    assert report["texts"][0]["text"] == "samples/texts/PSF-LICENSE.txt"  # no machine's folders in a report
    lossless, lossy = report["pooled"]
    assert (lossless["recipe"], lossless["lossy"], lossy["recipe"], lossy["lossy"]) == ("exphuff", False, "int:2|zstd:3", True)
    assert lossless["top1"] == 1.0 and lossless["ppl_change_pct"] == 0.0 and lossless["kl"] == 0.0
    assert lossless["greedy_identical"] == lossless["greedy_tokens"] == 8
    assert lossy["ratio"] > 2 * lossless["ratio"]
    assert lossy["kl"] > 0 and lossy["max_abs_error"] > 0
    assert lossy["keys_only"]["kl"] > 0 and lossy["values_only"]["kl"] > 0 and lossless["keys_only"] is None
    assert [t["target"].split(" with")[0] for t in report["targets"]] == ["ratio >= 2", "ratio >= 3", "ratio >= 5"]
    layers = report["layers"]
    assert sorted((r["layer"], r["kind"]) for r in layers) == [(l, k) for l in range(30) for k in "kv"]
    assert all(r["kl"] >= 0 for r in layers) and any(r["kl"] > 0 for r in layers)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_target_is_met_only_where_every_text_meets_it():
    from kvtool.bench.accuracy import Row, Target, verdict

    def row(text, recipe, ratio, ppl, top1=1.0, lossy=True):
        return Row(text=text, recipe=recipe, lossy=lossy, positions=256, raw_bytes=300, stored_bytes=100, ratio=ratio,
                   top1=top1, ppl=1.0, ppl_change_pct=ppl, kl=0.0, greedy_identical=0, greedy_tokens=8)

    rows = [row("a", "even", 3.2, 2.0), row("b", "even", 3.2, 2.5),
            row("a", "uneven", 3.5, 0.1), row("b", "uneven", 3.5, 3.4),  # pooled +1.75%, one text over 3%
            row("a", "lossless", 1.5, 0.0, lossy=False), row("b", "lossless", 1.5, 0.0, lossy=False)]
    pooled = [row("all", "even", 3.2, 2.25), row("all", "uneven", 3.5, 1.75), row("all", "lossless", 1.5, 0.0, lossy=False)]
    assert verdict(Target(3.0, 3.0), pooled, rows)["met_by"] == ["even"]
    missed = verdict(Target(3.0, 1.0), pooled, rows)
    assert missed["met_by"] == [] and missed["most_compact_accurate_enough"] is None
    assert missed["most_accurate_large_enough"] == "uneven"
    low_top1 = [row("a", "even", 3.2, 0.5, top1=0.98), row("b", "even", 3.2, 0.5, top1=1.0)]
    assert verdict(Target(2.0, 1.0, 0.99), [row("all", "even", 3.2, 0.5, top1=0.99)], low_top1)["met_by"] == []
