"""The crafted .kvz files of ``corpus/`` (see make_corpus.py): each ends in its documented error, bounded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from limits import MAX_SIZE, assert_bounded, sandbox  # noqa: F401 - sandbox is a fixture
from kvtool.kvz import DEFAULT_MAX_SIZE

HERE = Path(__file__).parent
MANIFEST = json.loads((HERE / "corpus.json").read_text())


def test_the_manifest_names_every_file():
    assert sorted(p.stem for p in (HERE / "corpus").glob("*.kvz")) == sorted(MANIFEST)


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_reader_ends_in_the_documented_error(sandbox, name):
    report = sandbox.run({"op": "read", "path": str(HERE / "corpus" / f"{name}.kvz"), "max_size": MAX_SIZE})
    assert_bounded(report)
    assert report["status"] == "error" and report["decode_error"], report
    assert report["type"] == MANIFEST[name]["error"], report
    assert all(not o["ok"] and o["decode_error"] for o in report["ops"].values()), report["ops"]


def test_a_claim_beyond_the_default_limit_is_refused_before_allocating(sandbox):
    """1 TiB per tensor in 8 GiB chunks: under the 16 GiB default each chunk passes, the read does not."""
    report = sandbox.run({"op": "read", "path": str(HERE / "corpus" / "claims-1TiB.kvz"), "max_size": DEFAULT_MAX_SIZE})
    assert_bounded(report)
    assert report["type"] == "KvzTooLargeError" and "over the limit" in report["message"], report


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_cli_fails_in_one_line(sandbox, tmp_path, name):
    path = str(HERE / "corpus" / f"{name}.kvz")
    runs = {
        "verify": ["verify", path, "--full", "--max-size", "64MiB"],
        "decompress": ["decompress", path, str(tmp_path / "out.safetensors"), "--threads", "1", "--max-size", "64MiB"],
        "inspect": ["inspect", path, "--json"],
    }
    for command, args in runs.items():
        report = sandbox.run({"op": "cli", "args": args})
        assert_bounded(report)
        assert report["exception"] is None, report["exception"]
        if command == "inspect" and report["exit_code"] == 0:  # it decodes nothing: a file may only claim too much
            assert json.loads(report["stdout"])["file"] == path
            continue
        assert report["exit_code"] == 4, (command, report)
        assert report["stderr"].startswith("kvtool: error: ") and report["stderr"].count("\n") == 1, report["stderr"]
    assert not (tmp_path / "out.safetensors").exists()
