"""What a careless or hostile user can hand the CLI: special files, the same path twice, absurd numbers,
broken metadata, misleading names, a killed run. Each is one line on stderr with a documented exit code."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import zstandard
from typer.testing import CliRunner

from kvtool.cache import KVCache
from kvtool.cli import app

runner = CliRunner()


class StillRunning(Exception):
    """Raised by ``within``; deliberately not an OSError (as TimeoutError is), which code may catch."""


@contextlib.contextmanager
def within(seconds: int):
    """Fail instead of hanging: SIGALRM interrupts even a blocking open()."""

    def expire(signum, frame):
        raise StillRunning(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run(*args, input=None):
    with within(60):
        result = runner.invoke(app, [str(a) for a in args], input=input)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def fill(args: list[str], **values) -> list[str]:
    """``args`` with ``{name}`` placeholders replaced (other braces, as in tensor-name patterns, kept)."""
    out = []
    for arg in args:
        for name, value in values.items():
            arg = arg.replace("{" + name + "}", str(value))
        out.append(arg)
    return out


def assert_one_line(result, code: int, message: str) -> None:
    assert result.exit_code == code, result.output
    assert result.stderr.startswith("kvtool: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr, result.stderr


def kvtool_process(*args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvtool", *map(str, args)], stderr=subprocess.PIPE, text=True, **kwargs)


# -- special files and the same path twice ---------------------------------------------------


@pytest.fixture
def specials(tmp_path) -> dict[str, Path]:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    return {"a FIFO": fifo, "a character device": Path("/dev/zero"), "a directory": tmp_path}


COMMANDS_READING_A_FILE = [
    ["compress", "{src}", "{tmp}/out.kvz"],
    ["compress", "{src}", "{tmp}/out.zst", "--codec", "zstd"],
    ["decompress", "{src}", "{tmp}/out.bin"],
    ["verify", "{src}"],
    ["inspect", "{src}"],
    ["reorder", "{src}", "{tmp}/out.safetensors", "--layout", "byteplane"],
    ["import", "{src}", "-o", "{tmp}/out.safetensors", "--pattern", "L{layer}.{k|v}"],
    ["dump", "{src}", "-o", "{tmp}/out.safetensors"],
    ["store", "put", "k", "{src}", "--store", "memory://"],
]


@pytest.mark.parametrize("command", COMMANDS_READING_A_FILE, ids=lambda c: " ".join(c[:2]))
def test_special_files_are_refused_at_once(command, specials, tmp_path):
    for kind, path in specials.items():
        result = run(*fill(command, src=path, tmp=tmp_path))
        assert_one_line(result, 2, f"not a regular file ({kind})")
    assert not list(tmp_path.glob("out*"))


def test_the_library_refuses_special_files_too(specials):
    import kvtool
    from kvtool.errors import UsageError

    for path in specials.values():
        with within(20), pytest.raises(UsageError, match="not a regular file"):
            kvtool.load(path)


def test_an_output_that_is_the_input_is_refused(samples, tmp_path):
    sample = tmp_path / "s.safetensors"
    sample.write_bytes(samples[0].read_bytes())
    kvz = tmp_path / "s.kvz"
    assert run("compress", sample, kvz).exit_code == 0
    (tmp_path / "link.kvz").symlink_to(kvz)
    os.link(sample, tmp_path / "hard.safetensors")
    before = {p.name: p.read_bytes() for p in (sample, kvz)}
    for args in (
        ["compress", sample, sample],
        ["compress", sample, tmp_path / "hard.safetensors"],
        ["decompress", kvz, kvz],
        ["decompress", kvz, tmp_path / "link.kvz"],
        ["decompress", kvz, tmp_path / "sub" / ".." / "s.kvz"],
        ["reorder", sample, sample, "--layout", "byteplane"],
        ["import", sample, "-o", sample, "--pattern", "layer.{layer}.{key|value}"],
    ):
        assert_one_line(run(*args), 2, "is the input file")
    assert {p.name: p.read_bytes() for p in (sample, kvz)} == before


# -- numbers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kvz(samples, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("kvz") / "c.kvz"
    assert runner.invoke(app, ["compress", str(samples[0]), str(path), "--chunk-tokens", "64"]).exit_code == 0
    return path


@pytest.mark.parametrize(
    "layers, message",
    [
        ("0-100000000", "more than 65536 layers"),
        ("3-1", "runs backwards"),
        ("1,1", "names a layer twice"),
        ("0-3,2", "names a layer twice"),
        ("-1", "bad layer list"),
        ("1e3", "bad layer list"),
        ("", None),
    ],
)
def test_layer_lists_are_checked_before_anything_is_read(kvz, tmp_path, layers, message):
    out = tmp_path / "part.safetensors"
    started = time.monotonic()
    result = run("decompress", kvz, out, "--layers", layers)
    assert time.monotonic() - started < 30  # 10^8 layer ids once took minutes to list
    if message is None:  # an empty list means every layer
        assert result.exit_code == 0 and KVCache.load(out).num_layers == 30
        return
    assert_one_line(result, 2, message)
    assert not out.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["decompress", "{kvz}", "{tmp}/o", "--threads", "-1"], "greater than or equal to 0"),
        (["compress", "{sample}", "{tmp}/o.kvz", "--threads", "-1"], "greater than or equal to 0"),
        (["decompress", "{kvz}", "{tmp}/o", "--max-size", "1e400"], "not a size"),
        (["decompress", "{kvz}", "{tmp}/o", "--max-size", "nan"], "not a size"),
        (["decompress", "{kvz}", "{tmp}/o", "--max-size", "-1"], "not a size"),
        (["decompress", "{kvz}", "{tmp}/o", "--max-size", "1e30"], "too large"),
        (["verify", "{kvz}", "--max-size", "1e400"], "not a size"),
        (["store", "stats", "--store", "memory://?capacity=1e400"], "not a size"),
        (["store", "ls", "--store", "file://{tmp}/s?capacity=inf"], "not a size"),
        (["compress", "{sample}", "{tmp}/o.kvz", "--chunk-tokens", "0"], "chunk tokens must be"),
    ],
)
def test_absurd_numbers_are_usage_errors(kvz, samples, tmp_path, args, message):
    result = run(*fill(args, kvz=kvz, sample=samples[0], tmp=tmp_path))
    assert_one_line(result, 2, message)


def test_usage_errors_are_value_errors_for_hosts_and_exit_2_for_the_cli(tmp_path):
    """vLLM's tier factory and LMCache's adapter config treat a ValueError as the user's mistake."""
    from kvtool.errors import UsageError
    from kvtool.recipe import Recipe
    from kvtool.store import open_store

    with pytest.raises(ValueError, match="nosuch") as info:
        Recipe.parse("nosuch:3")
    assert isinstance(info.value, UsageError)
    store = open_store("memory://")
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.get("k")
    assert_one_line(run("store", "stats", "--store", "nosuch://x"), 2, "nosuch")


def test_the_decode_limit_applies_to_kvz_files(kvz, tmp_path):
    out = tmp_path / "o.safetensors"
    assert_one_line(run("decompress", kvz, out, "--max-size", "1MiB"), 4, "over the limit of 1048576")
    assert_one_line(run("verify", kvz, "--full", "--max-size", "1KiB"), 4, "over the limit of 1024")
    assert not out.exists()
    assert run("decompress", kvz, out, "--max-size", "1MiB", "--layers", "0", "--tokens", "0:64").exit_code == 0


# -- contents -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("kvtool.token_start", "abc"),
        ("kvtool.token_start", "-5"),
        ("kvtool.model", "{not json"),
        ("kvtool.model", '{"num_layers": "thirty"}'),
        ("kvtool.model", "[1]"),
        ("kvtool.provenance", "[1]"),
        ("kvtool.provenance", "[" * 100_000),
    ],
)
def test_malformed_safetensors_metadata_is_a_decode_error(samples, tmp_path, field, value):
    cache = KVCache.load(samples[0], layers=[0], tokens=slice(0, 8))
    tensors = {f"layer.0.{name}": np.ascontiguousarray(a) for name, a in (("key", cache.keys[0]), ("value", cache.values[0]))}
    path = tmp_path / "bad.safetensors"
    path.write_bytes(safetensors.numpy.save(tensors, metadata={**cache.header_metadata(), field: value}))
    for args in (["inspect", path], ["compress", path, tmp_path / "o.kvz"], ["reorder", path, tmp_path / "r", "--layout", "byteplane"]):
        assert_one_line(run(*args), 4, "bad kvtool metadata")
    assert not list(tmp_path.glob("o.kvz*"))


def test_what_is_not_a_kv_cache_is_not_written_as_a_kvz(samples, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a KV cache\n" * 100)
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(samples[0].read_bytes()[:100_000])
    assert_one_line(run("compress", text, tmp_path / "notes.kvz"), 2, "notes.txt is not a KV cache")
    assert_one_line(run("compress", truncated, tmp_path / "cut.kvz"), 2, "not a readable safetensors file")
    assert_one_line(run("compress", samples[0], tmp_path / "s.kvz", "--codec", "lz4"), 2, "--codec writes a plain codec stream")
    assert not list(tmp_path.glob("*.kvz"))
    result = run("compress", truncated, tmp_path / "cut.zst")  # a plain stream is what was asked for; it says so
    assert result.exit_code == 0 and "is not a KV cache" in result.stderr
    assert run("decompress", tmp_path / "cut.zst", tmp_path / "back").exit_code == 0
    assert (tmp_path / "back").read_bytes() == truncated.read_bytes()


def test_keys_that_are_not_valid_unicode_are_refused(tmp_path):
    store = f"file://{tmp_path}/store"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtool", "store", "put", b"key\xff", "-", "--store", store],
        input=b"value", capture_output=True, timeout=60,
    )
    assert proc.returncode == 2 and b"is not Unicode text" in proc.stderr and proc.stderr.count(b"\n") == 1
    assert not list(tmp_path.glob("store/entries/*/*.kve"))


# -- plain streams under a memory limit -------------------------------------------------------


def limited_memory():
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


@pytest.mark.parametrize("codec", ["lz4", "zstd-without-size"])
def test_plain_streams_decode_without_reserving_max_size(samples, tmp_path, codec):
    """The default --max-size is 16 GiB; a 6 MB stream must decode under a 2 GiB address-space limit."""
    src = samples[0]
    packed = tmp_path / "blob"
    if codec == "lz4":
        assert run("compress", src, packed, "--codec", "lz4").exit_code == 0
    else:  # as `zstd` writes from a pipe: no content size in the frame
        packed.write_bytes(zstandard.ZstdCompressor(write_content_size=False).compress(src.read_bytes()))
    codec_id = codec.partition("-")[0]
    proc = subprocess.run(
        [sys.executable, "-m", "kvtool", "decompress", packed, tmp_path / "out", "--codec", codec_id],
        capture_output=True, text=True, timeout=120, preexec_fn=limited_memory,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out").read_bytes() == src.read_bytes()


# -- interrupted runs -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_cache(samples, tmp_path_factory) -> Path:
    """A 2,048-token cache (47 MB): slow enough to compress with zstd level 19 to be interrupted."""
    cache = KVCache.load(samples[0])
    tiled = KVCache([np.concatenate([k] * 8, axis=1) for k in cache.keys], [np.concatenate([v] * 8, axis=1) for v in cache.values], cache.model, cache.provenance)
    path = tmp_path_factory.mktemp("big") / "big.safetensors"
    tiled.save(path)
    return path


def start_slow_compress(src: Path, out: Path) -> subprocess.Popen:
    proc = kvtool_process("compress", src, out, "--recipe", "byteplane|zstd:19", "--threads", "1")
    deadline = time.monotonic() + 60
    while not list(out.parent.glob(f".{out.name}.*.part")):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "compress never started writing"
        time.sleep(0.05)
    return proc


def test_sigterm_leaves_no_partial_file(big_cache, tmp_path):
    out = tmp_path / "out.kvz"
    proc = start_slow_compress(big_cache, out)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert "kvtool: terminated" in proc.stderr.read()
    assert list(tmp_path.iterdir()) == []


def test_a_killed_run_leaves_a_partial_file_the_next_run_removes(big_cache, samples, tmp_path):
    out = tmp_path / "out.kvz"
    proc = start_slow_compress(big_cache, out)
    proc.kill()
    proc.wait(timeout=60)
    proc.stderr.close()
    assert len(list(tmp_path.glob(".out.kvz.*.part"))) == 1
    assert run("compress", samples[0], out).exit_code == 0
    assert [p.name for p in tmp_path.iterdir()] == ["out.kvz"]


def test_a_killed_runs_partial_file_is_removed_by_the_next_write_in_its_folder(big_cache, samples, tmp_path):
    proc = start_slow_compress(big_cache, tmp_path / "killed.kvz")
    proc.kill()
    proc.wait(timeout=60)
    proc.stderr.close()
    (tmp_path / ".notes.txt.part").write_bytes(b"not kvtool's")  # not an atomic write's name: left alone
    assert run("compress", samples[0], tmp_path / "other.kvz").exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".notes.txt.part", "other.kvz"]


def test_outputs_that_cannot_be_files_are_refused_before_any_work(samples, tmp_path):
    (tmp_path / "real-dir").mkdir()
    (tmp_path / "link-to-dir").symlink_to(tmp_path / "real-dir")
    (tmp_path / "a-file").write_bytes(b"x")
    cases = {
        tmp_path / "no-dir" / "x.kvz": f"cannot write {tmp_path}/no-dir/x.kvz: the folder {tmp_path}/no-dir does not exist",
        tmp_path / "a-file" / "x.kvz": f"cannot write {tmp_path}/a-file/x.kvz: the folder {tmp_path}/a-file is not a directory",
        tmp_path / "link-to-dir": f"the output {tmp_path}/link-to-dir is a directory (a symbolic link to a directory); name a file in it",
        tmp_path / "real-dir": f"the output {tmp_path}/real-dir is a directory; name a file in it",
    }
    store = f"file://{tmp_path}/store"
    assert run("store", "put", "k", "-", "--store", store, input=b"value").exit_code == 0
    for out, message in cases.items():
        for args in (["compress", samples[0], out], ["store", "get", "k", "-o", out, "--store", store]):
            result = run(*args)
            assert result.exit_code == 2, result.output
            assert result.stderr.strip() == f"kvtool: error: {message}", result.stderr
    assert (tmp_path / "link-to-dir").is_symlink() and list((tmp_path / "real-dir").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "link-to-dir", "real-dir", "store"]


def test_a_thread_count_no_machine_has_is_refused(samples, tmp_path):
    for args in (["compress", samples[0], tmp_path / "x.kvz"], ["bench", samples[0], "-r", "zstd:3"]):
        result = run(*args, "--threads", "100000")
        assert result.exit_code == 2 and "--threads" in result.stderr and "1024" in result.stderr
    assert not (tmp_path / "x.kvz").exists()


@pytest.mark.parametrize("plant", ["fifo", "directory"])
def test_special_files_planted_in_a_file_store(tmp_path, plant):
    store = tmp_path / "store"
    assert run("store", "put", "k", "-", "--store", f"file://{store}", input=b"value").exit_code == 0
    (entry,) = store.glob("entries/*/*.kve")
    planted = entry.with_name("ab" * 20 + ".kve")
    os.mkfifo(planted) if plant == "fifo" else planted.mkdir()
    with within(5):
        result = runner.invoke(app, ["store", "ls", "--json", "--store", f"file://{store}"])
    if isinstance(result.exception, StillRunning):
        raise result.exception
    assert result.exit_code == 0 and [r["key"] for r in json.loads(result.stdout)] == ["k"], result.output


def test_a_recipe_cut_by_the_shell_is_told_to_quote_it(samples, tmp_path):
    """`--recipe byteplane|zstd:1` unquoted reaches kvtool as 'byteplane': the advice says to quote it."""
    result = run("compress", samples[0], tmp_path / "x.kvz", "--recipe", "byteplane")
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "quote the whole recipe ('byteplane|zstd:1')" in result.stderr
    whole = run("compress", samples[0], tmp_path / "x.kvz", "--recipe", "byteplane|channel-major")
    assert whole.exit_code == 2 and "quote" not in whole.stderr
