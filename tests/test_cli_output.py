"""What the command line says: start-up, help, success summaries, tables, global options."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

import kvtool
from kvtool.cache import KVCache
from kvtool.cli import app
from kvtool.store import prefix_keys

runner = CliRunner()
WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}


def run(*args, env=None, input=None):
    return runner.invoke(app, [str(a) for a in args], env=env, input=input)


def python(code: str, **env) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout


# --- start-up -----------------------------------------------------------------------------------


def test_version_answers_without_importing_typer():
    out = python("import sys; sys.argv = ['kvtool', '--version']; from kvtool.cli import main; main(); "
                 "print(sorted(m for m in ('typer', 'numpy', 'kvtool.cli.root') if m in sys.modules))")
    assert out.splitlines() == [f"kvtool {kvtool.__version__}", "[]"]


def test_a_command_imports_only_its_own_module():
    out = python("import sys; from typer.testing import CliRunner; from kvtool.cli import app; "
                 "assert CliRunner().invoke(app, ['codecs', '--json']).exit_code == 0; "
                 "print(sorted(m for m in ('kvtool.bench.matrix', 'kvtool.cli.bench', 'kvtool.cli.store') if m in sys.modules))")
    assert out.strip() == "[]"


def test_help_lists_every_command_without_importing_one():
    out = python("import sys; from typer.testing import CliRunner; from kvtool.cli import app; "
                 "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output; "
                 "print(sorted(m for m in sys.modules if m.startswith('kvtool.cli.') and m not in "
                 "('kvtool.cli.root', 'kvtool.cli._common')), 'numpy' in sys.modules)")
    assert out.strip() == "[] False"


def test_the_listed_help_of_each_command_is_its_own():
    """``kvtool --help`` lists commands from a table; each line must be the command's docstring's first."""
    from kvtool.cli.root import COMMANDS, app as root_app

    group = typer.main.get_group(root_app)
    for name, (_, listed) in COMMANDS.items():
        command = group.get_command(None, name)
        assert command.get_short_help_str(limit=10_000) == listed, name


def test_commands_that_hold_no_cache_load_no_ml_dtypes(tmp_path):
    """ml_dtypes costs most of a start-up (0.7 s of CPU): commands that never hold a cache's values skip it."""
    store = f"file://{tmp_path}/store"
    assert run("store", "put", "k", "-", "--store", store, input=b"v").exit_code == 0
    out = python("import sys; from typer.testing import CliRunner; from kvtool.cli import app; "
                 "run = lambda *a: CliRunner().invoke(app, list(a)).exit_code; "
                 f"assert run('codecs') == 0 and run('store', 'ls', '--store', {store!r}) == 0; "
                 "assert run('plan', '--layers', '2', '--kv-heads', '1', '--head-dim', '8', '--hardware', 'h800', "
                 "'--prefill-tps', '100') == 0; "
                 "print('ml_dtypes' in sys.modules)")
    assert out.strip() == "False"


def test_import_kvtool_store_needs_no_numpy():
    assert python("import sys, kvtool.store; print('numpy' in sys.modules)").strip() == "False"


def test_prefix_keys_of_a_list_and_an_array_agree():
    ids = [0, 1, 2**32 - 1, 7] * 40
    for tokens in (ids, tuple(ids), np.array(ids, np.int64), np.array(ids, np.uint32), [np.int64(t) for t in ids]):
        assert prefix_keys(tokens, 32, "m", "r") == prefix_keys(ids, 32, "m", "r")
    for bad in ([1.0], [[1]], [True], [-1], [2**32]):
        with pytest.raises(kvtool.errors.UsageError):
            prefix_keys(bad, 32, "m", "r")


def test_unknown_command_suggests_one_that_is_not_loaded_yet():
    result = run("comprss")
    assert result.exit_code == 2 and "Did you mean 'compress'" in result.output


# --- help ---------------------------------------------------------------------------------------


def test_help_names_arguments_and_defaults():
    text = run("compress", "--help", env=WIDE).output
    assert "Usage: kvtool compress [OPTIONS] SRC DST" in text
    assert "<bool>" not in text and "{src}" not in text
    assert f"[default: ({kvtool.DEFAULT_RECIPE})]" in text
    assert "Read SRC as a KV cache" in text
    assert "<bool>" not in run("--help", env=WIDE).output


def test_bench_help_shows_the_compression_options():
    text = run("bench", "--help", env=WIDE).output
    assert "ttft" in text and "--recipes" in text and "--no-peers" in text


def test_shell_completion_is_offered():
    text = run("--help", env=WIDE).output
    assert "--install-completion" in text and "--show-completion" in text
    script = python("from kvtool.cli import main; main()", _KVTOOL_COMPLETE="source_bash")
    assert "_kvtool_completion" in script and "complete_bash" in script

    def complete(words: str) -> list[str]:  # what the bash script asks kvtool for
        return python("from kvtool.cli import main; main()", _KVTOOL_COMPLETE="complete_bash",
                      COMP_WORDS=words, COMP_CWORD=str(len(words.split()) - 1)).split()

    assert complete("kvtool comp") == ["compress"]  # from the command table, before any command module loads
    assert set(complete("kvtool store p")) == {"put", "pin", "prefetch"}


# --- global options -----------------------------------------------------------------------------


def test_verbose_and_quiet_set_the_log_level(samples, tmp_path):
    assert run("-vv", "codecs", "--json").exit_code == 0
    assert logging.getLogger("kvtool").level == logging.DEBUG
    quiet = run("-q", "compress", samples[0], tmp_path / "c.kvz")
    assert quiet.exit_code == 0 and quiet.output == ""
    assert logging.getLogger("kvtool").level == logging.ERROR
    both = run("-v", "-q", "codecs")
    assert both.exit_code == 2 and "not both" in both.output
    assert run("codecs", "--json").exit_code == 0  # back to the default
    assert logging.getLogger("kvtool").level == logging.WARNING


# --- success summaries --------------------------------------------------------------------------


def test_compress_and_decompress_say_what_they_wrote(samples, tmp_path):
    kvz, back = tmp_path / "c.kvz", tmp_path / "back.safetensors"
    made = json.loads(run("compress", samples[0], kvz, "--recipe", "byteplane|zstd:1", "--json").stdout)
    assert made["out_bytes"] == kvz.stat().st_size and made["in_bytes"] == samples[0].stat().st_size
    assert made["recipe"] == "byteplane|zstd:1"
    assert made["ratio"] == pytest.approx(KVCache.load(samples[0]).nbytes / kvz.stat().st_size, abs=1e-4)
    line = run("decompress", kvz, back).stdout
    assert line.startswith(f"{kvz} -> {back}: ") and f"ratio {made['ratio']:.3f}" in line and line.count("\n") == 1
    part = json.loads(run("decompress", kvz, tmp_path / "p.safetensors", "--layers", "7", "--tokens", "0:128", "--json").stdout)
    assert (part["layers"], part["tokens"], part["ratio"]) == ([7], "0:128", None)
    plain = json.loads(run("compress", samples[0].parent / "README.md", tmp_path / "r.zst", "--json").stdout)
    assert plain["codec"] == "zstd:3" and plain["out_bytes"] == (tmp_path / "r.zst").stat().st_size


@pytest.mark.parametrize("tokens", ["0:9999", "256:", "300:400"])
def test_a_token_range_past_the_cache_is_an_error(samples, tmp_path, tokens):
    kvz = tmp_path / "c.kvz"
    assert run("compress", samples[0], kvz).exit_code == 0
    result = run("decompress", kvz, tmp_path / "p.safetensors", "--tokens", tokens)
    assert result.exit_code == 2 and "runs past the cache, which holds 256 tokens" in result.output
    assert not (tmp_path / "p.safetensors").exists()


@pytest.mark.parametrize("tokens", ["5:3", "-5:", "a:b"])
def test_a_bad_token_range_is_an_error(samples, tmp_path, tokens):
    kvz = tmp_path / "c.kvz"
    assert run("compress", samples[0], kvz).exit_code == 0
    assert run("decompress", kvz, tmp_path / "p.safetensors", "--tokens", tokens).exit_code == 2


def test_store_put_reports_and_ls_shows_the_tokens_of_a_kvz(samples, tmp_path):
    kvz, url = tmp_path / "c.kvz", f"file://{tmp_path}/store"
    assert run("compress", samples[0], kvz).exit_code == 0
    put = json.loads(run("store", "put", "s1", kvz, "--store", url, "--json").stdout)
    assert (put["key"], put["bytes"], put["tokens"], put["store"]) == ("s1", kvz.stat().st_size, 256, url)
    assert f"stored 's2' in {url}: 5 B" in run("store", "put", "s2", "-", "--store", url, input=b"plain").stdout
    rows = {r["key"]: r for r in json.loads(run("store", "ls", "--json", "--store", url).stdout)}
    assert (rows["s1"]["tokens"], rows["s2"]["tokens"]) == (256, None)
    table = run("store", "ls", "--store", url).stdout.splitlines()
    assert table[0].split() == ["key", "tier", "size", "tokens"] and table[1].split()[-1] == "256"


def test_reorder_counts_as_its_json_does_and_inspect_points_to_inverse(samples, tmp_path):
    out = tmp_path / "cm.safetensors"
    report = json.loads(run("reorder", samples[0], out, "--layout", "channel-major|byteplane", "--json").stdout)
    line = run("reorder", samples[0], tmp_path / "cm2.safetensors", "--layout", "channel-major|byteplane").stdout
    assert f"30 layers x K/V as {report['tensors']} tensors" in line and report["tensors"] == 120
    result = run("inspect", out)
    assert result.exit_code == 2 and f"kvtool reorder {out} OUT.safetensors --inverse" in result.output


# --- tables -------------------------------------------------------------------------------------


def test_bench_marks_the_best_ratio_and_explains_its_columns(samples, tmp_path):
    small = tmp_path / "small.safetensors"
    KVCache.load(samples[0], layers=[0, 29], tokens=slice(0, 64)).save(small)
    args = ["bench", small, "--repeat", "1", "--threads", "2", "--no-peers", "-r", "zstd:3", "-r", kvtool.DEFAULT_RECIPE]
    report = json.loads(run(*args, "--json").stdout)
    ratios = {r["recipe"]: r["ratio"] for r in report["files"][0]["results"]}
    best = max(ratios, key=ratios.get)
    text = run(*args).stdout
    rows = {line.split()[0]: line for line in text.splitlines() if line.split() and line.split()[0] in ratios}
    assert rows[best].split()[1] == "*" and "*" not in rows[min(ratios, key=ratios.get)]
    for term in ("% limit:", "vs zstd:3:", "cpu s/GB c, d:", "planes:", "the best lossless ratio"):
        assert term in text


def test_plan_prints_tables_with_readable_sizes():
    text = run("plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--hardware", "h800",
               "--prefill-tps", "15000").stdout
    assert "{" not in text  # no Python dict
    assert "128.0 KiB/token" in text and "256.0 GiB" in text  # 64 sessions x 32768 tokens x 128 KiB
    assert "Break-even" in text and "Time to first token" in text


def test_codecs_table_keeps_reasons_in_the_last_column():
    lines = run("codecs").stdout.splitlines()
    assert lines[0].split() == ["id", "status", "runs", "on", "(or", "why", "not)"]
    assert {line.split()[1] for line in lines[1:]} <= {"available", "unavailable"}


# --- where an installed kvtool looks ------------------------------------------------------------


def test_libqatzip_is_found_in_the_user_data_directory(tmp_path):
    from kvtool.codecs import _qatzip

    try:
        real = Path(_qatzip.load().path)
    except kvtool.errors.UnavailableError as exc:
        pytest.skip(f"libqatzip is not installed here: {exc}")
    if not any(real.resolve().is_relative_to(root.resolve()) for root in _unpacked_roots_of_this_run()):
        pytest.skip(f"libqatzip comes from the system ({real}), which is tried before the data directory")
    lib_dir = tmp_path / "kvtool" / "qatzip" / "usr" / "lib" / real.parent.name
    lib_dir.mkdir(parents=True)
    for name in (_qatzip.SONAME, *_qatzip._DEPENDENCIES):
        if (real.parent / name).exists():
            (lib_dir / name).symlink_to(real.parent / name)
    env = {k: v for k, v in os.environ.items() if k not in ("KVTOOL_QATZIP_LIB", "PYTHONPATH")}
    env["XDG_DATA_HOME"] = str(tmp_path)
    env["PYTHONPATH"] = str(Path(kvtool.__file__).parents[1])
    done = subprocess.run([sys.executable, "-m", "kvtool", "codecs", "--json"], capture_output=True, text=True, env=env)
    qat = next(row for row in json.loads(done.stdout) if row["id"] == "qat")
    assert qat["available"] and str(lib_dir) in qat["implementation"], qat


def _unpacked_roots_of_this_run() -> list[Path]:
    """Where the library under test may come from, other than the system loader."""
    from kvtool.codecs import _qatzip

    env = os.environ.get("KVTOOL_QATZIP_LIB")
    return _qatzip._unpacked_roots() + ([Path(env).parents[3]] if env else [])


def test_verbose_logs_each_step_of_compress_verify_and_store_put(tmp_path, samples):
    kvz = tmp_path / "c.kvz"
    steps = {
        ("compress", samples[0], kvz): ["reading the KV cache", "read 30 layers x K/V of 256 tokens", "encoding with exphuff",
                                        "wrote "],
        ("verify", kvz, "--full"): ["reading the header and index", "checking every checksum, then decoding every chunk"],
        ("store", "put", "k", kvz, "--store", f"memory://,file://{tmp_path}/s"): [
            "reading ", "a .kvz of 256 tokens", "opening the store", "memory://", "file://", "putting 'k'", "closing "],
    }
    for args, expected in steps.items():
        quiet, verbose = run(*args), run("-v", *args)
        assert quiet.exit_code == verbose.exit_code == 0, verbose.output
        assert "INFO" not in quiet.stderr
        logged = [line for line in verbose.stderr.splitlines() if line.startswith("kvtool: INFO kvtool.cli.")]
        assert len(logged) == len(expected), logged
        for line, phrase in zip(logged, expected):
            assert phrase in line, (line, phrase)
