"""``kvtool store``: put, get, ls, stats and evict through the command line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.cli.store import default_store_url


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_STORE", f"file://{tmp_path}/store")
    runner = CliRunner()

    def invoke(*args, input=None):
        return runner.invoke(app, ["store", *args], input=input)

    return invoke


def test_put_get_round_trip_through_files_and_pipes(run, tmp_path):
    source = tmp_path / "blob.bin"
    source.write_bytes(bytes(range(256)) * 10)
    assert run("put", "from-file", str(source), "--tokens", "12").exit_code == 0
    assert run("put", "from-stdin", "-", input=b"\x00piped\xff").exit_code == 0
    out = tmp_path / "out.bin"
    got = run("get", "from-file", "-o", str(out))
    assert got.exit_code == 0 and got.stdout == f"wrote 'from-file' from file://{tmp_path}/store to {out}: 2.5 KiB\n"
    assert out.read_bytes() == source.read_bytes()
    result = run("get", "from-stdin")
    assert result.exit_code == 0 and result.stdout_bytes == b"\x00piped\xff"


def test_ls_and_stats_as_json(run, tmp_path):
    run("put", "a", "-", "--tokens", "3", input=b"aaa")
    run("put", "b", "-", input=b"bb")
    rows = json.loads(run("ls", "--json").stdout)
    assert sorted((r["key"], r["tier"], r["tokens"]) for r in rows) == [("a", "file", 3), ("b", "file", None)]
    stats = json.loads(run("stats", "--json").stdout)
    assert stats["entries"] == 2 and stats["store"] == f"file://{tmp_path}/store"
    table = run("stats").stdout
    assert "file" in table and "unbounded" in table


def test_evict_and_missing_keys(run):
    run("put", "a", "-", input=b"a")
    assert run("evict", "a").exit_code == 0
    for args in (("evict", "a"), ("get", "a")):
        result = run(*args)
        assert result.exit_code == 1
        assert result.stderr.startswith("kvtool: error: no entry 'a' in file://")
        assert len(result.stderr.strip().splitlines()) == 1


def test_tiered_store_from_the_command_line(run, tmp_path):
    url = f"memory://?capacity=1MiB,file://{tmp_path}/tiers"
    assert run("put", "k", "-", "--store", url, input=b"value").exit_code == 0
    # the memory tier dies with each command; its entries were saved to the file tier on close
    rows = json.loads(run("ls", "--json", "--store", url).stdout)
    assert [(r["key"], r["tier"]) for r in rows] == [("k", "file")]
    assert run("get", "k", "--store", url).stdout_bytes == b"value"
    stats = json.loads(run("stats", "--json", "--store", url).stdout)
    assert [t["tier"] for t in stats["tiers"]] == ["memory", "file"]
    assert run("evict", "k", "--store", url).exit_code == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (("ls", "--store", "bogus"), "not a store URL"),
        (("ls", "--store", "memory://?size=1"), "unknown option 'size'"),
        (("put", "k", "/no/such/file"), "no such file"),
        (("put", "bad\nkey", "-"), "invalid store key"),
    ],
)
def test_user_errors_are_one_line(run, args, message):
    result = run(*args, input=b"")
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_default_store_is_under_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_store_url() == f"file://{tmp_path}/xdg/kvtool/store"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_store_url() == f"file://{tmp_path}/home/.cache/kvtool/store"
    monkeypatch.delenv("KVTOOL_STORE", raising=False)
    result = CliRunner().invoke(app, ["store", "put", "k", "-"], input=b"v")
    assert result.exit_code == 0
    assert list((tmp_path / "home" / ".cache" / "kvtool" / "store" / "entries").rglob("*.kve"))


def _snapshot(root):
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted((root / "entries").rglob("*")) if p.is_file()}


def test_ls_and_stats_never_change_the_store(run, tmp_path):
    root = tmp_path / "store"
    for key in "abcd":
        run("put", key, "-", input=key.encode() * 1000)
    damaged = next((root / "entries").rglob("*.kve"))
    damaged.write_bytes(damaged.read_bytes()[:-1])
    before = _snapshot(root)
    small = f"file://{root}?capacity=1KiB"  # smaller than what the store holds
    for args in (("ls", "--json"), ("stats", "--json"), ("stats", "--prometheus"), ("ls", "--store", small),
                 ("stats", "--store", small), ("ls", "--store", f"memory://,{small}")):
        assert run(*args).exit_code == 0, args
    assert _snapshot(root) == before
    assert len(json.loads(run("ls", "--json").stdout)) == 4


def test_stats_in_prometheus_format(run):
    run("put", "a", "-", "--tokens", "3", input=b"a" * 100)
    text = run("stats", "--prometheus").stdout
    assert 'kvtool_store_entries{tier="file"} 1.0' in text
    assert "# TYPE kvtool_store_evictions_total counter" in text
    assert 'kvtool_store_used_bytes{tier="file"}' in text


def test_a_store_named_on_the_command_line_wins_over_kvtool_api(run, tmp_path, monkeypatch):
    """KVTOOL_API (exported for the scheduling verbs) does not redirect a command given --store."""
    monkeypatch.setenv("KVTOOL_API", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("KVTOOL_API_TOKEN", "t" * 32)
    named = f"file://{tmp_path}/named"
    assert run("put", "k", "-", "--store", named, input=b"v").exit_code == 0
    assert run("get", "k", "--store", named).stdout_bytes == b"v"
    through_api = run("ls")  # no --store: the API, which does not answer
    assert through_api.exit_code != 0 and "kvtool API at http://127.0.0.1:9" in through_api.stderr
