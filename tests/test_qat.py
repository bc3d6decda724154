"""gzip, and qat and isal forcing its QATzip and ISA-L encoders: plain gzip for each other, gzip(1), Python's gzip and the CLI.

Tests that encode through QATzip are skipped, with the reason, where libqatzip is
missing (scripts/install-qatzip.sh installs it); decoding needs no QATzip and is
tested everywhere.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.codecs import _qatzip, _qatzip_fallback, _qatzip_session, get_codec
from kvtool.errors import OutputTooLargeError
from kvtool.testing import require_available
from kvtool.testing.data import kv_like_bf16

GZIP = shutil.which("gzip")
needs_gzip = pytest.mark.skipif(GZIP is None, reason="the gzip command is not installed")


@pytest.fixture(scope="module")
def data() -> bytes:
    return kv_like_bf16(tokens=1000, seed=5).tobytes() + b"odd tail"


def _gunzip_cli(blob: bytes) -> bytes:
    return subprocess.run([GZIP, "-dc"], input=blob, capture_output=True, check=True).stdout


def _gzip_cli(blob: bytes) -> bytes:
    return subprocess.run([GZIP, "-c"], input=blob, capture_output=True, check=True).stdout


def _count_members(blob: bytes) -> int:
    count = 0
    while blob:
        dobj = zlib.decompressobj(31)
        dobj.decompress(blob)
        assert dobj.eof
        blob, count = dobj.unused_data, count + 1
    return count


@needs_gzip
@pytest.mark.parametrize("spec", ["gzip", "gzip:9", "qat", "qat:9", "isal:0", "isal:3"])
def test_output_is_plain_gzip(spec: str, data: bytes):
    require_available(spec)
    encoded = get_codec(spec).encode(data)
    assert encoded[:2] == b"\x1f\x8b"
    assert gzip.decompress(encoded) == data
    assert _gunzip_cli(encoded) == data


@needs_gzip
@pytest.mark.parametrize("spec", ["qat", "isal"])
def test_decodes_gzip_from_other_tools(spec: str, data: bytes):
    codec = get_codec(spec)
    for stream in (_gzip_cli(data), gzip.compress(data, 9), gzip.compress(b"")):
        expected = gzip.decompress(stream)
        assert codec.decode(stream, max_size=len(expected)) == expected


@pytest.mark.parametrize("spec", ["qat", "isal"])
def test_multi_member_gzip(spec: str, data: bytes):
    stream = gzip.compress(data[:1000]) + gzip.compress(b"") + gzip.compress(data[1000:], 1)
    codec = get_codec(spec)
    assert codec.decode(stream, max_size=len(data)) == data
    with pytest.raises(OutputTooLargeError):
        codec.decode(stream, max_size=len(data) - 1)


def test_qat_and_isal_read_each_other(data: bytes):
    require_available("qat", "isal")
    qat, isal = get_codec("qat"), get_codec("isal:2")
    assert isal.decode(qat.encode(data), max_size=len(data)) == data
    assert qat.decode(isal.encode(data), max_size=len(data)) == data


def test_large_input_becomes_several_members(monkeypatch, data: bytes):
    require_available("qat")
    monkeypatch.setattr(_qatzip_session, "_MAX_CALL", 50_000)
    encoded = get_codec("qat").encode(data)
    assert _count_members(encoded) == -(-len(data) // 50_000)
    assert gzip.decompress(encoded) == data
    assert get_codec("qat").decode(encoded, max_size=len(data)) == data


def test_codecs_json_reports_qatzip():
    require_available("qat")
    result = CliRunner().invoke(app, ["codecs", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["id"]: row for row in json.loads(result.stdout)}
    qat = rows["qat"]
    assert qat["available"], qat["reason"]
    assert "libqatzip" in qat["implementation"] and qat["library"]
    expected = "QAT hardware" if qat["hardware"] else "software fallback"
    assert expected in qat["implementation"]
    assert rows["isal"]["available"]


@needs_gzip
def test_cli_round_trips_with_gzip(tmp_path: Path, data: bytes):
    require_available("qat")
    runner = CliRunner()
    src = tmp_path / "blob.bin"
    src.write_bytes(data)

    packed = tmp_path / "blob.qat.gz"
    result = runner.invoke(app, ["compress", "--codec", "qat", str(src), str(packed)])
    assert result.exit_code == 0, result.output
    assert _gunzip_cli(packed.read_bytes()) == data

    gz = tmp_path / "blob.gz"
    gz.write_bytes(_gzip_cli(data))
    out = tmp_path / "blob.out"
    result = runner.invoke(app, ["decompress", "--codec", "qat", str(gz), str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == data


def test_missing_library_is_unavailable_but_decode_works(tmp_path: Path):
    """Run in a fresh process: the library is loaded (or not) once per process."""
    script = textwrap.dedent(
        """
        import gzip, json
        from kvtool.codecs import get_codec
        from kvtool.codecs.qat import QatCodec
        from kvtool.errors import UnavailableError

        avail = QatCodec.available()
        blob = gzip.compress(b"kv" * 1000)
        decoded = get_codec("qat").decode(blob, max_size=2000) == b"kv" * 1000
        try:
            get_codec("qat").encode(b"x")
            encode_error = None
        except UnavailableError as exc:
            encode_error = str(exc)
        print(json.dumps({"ok": avail.ok, "reason": avail.reason, "decoded": decoded,
                          "encode_error": encode_error, "details": QatCodec.details()}))
        """
    )
    missing = tmp_path / "no" / "libqatzip.so.3"
    env = {**os.environ, _qatzip.ENV_VAR: str(missing)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    report = json.loads(proc.stdout)
    assert report["ok"] is False
    assert str(missing) in report["reason"] and _qatzip.ENV_VAR in report["reason"]
    assert report["decoded"] is True
    assert report["encode_error"] and str(missing) in report["encode_error"]
    assert report["details"] == {"encoder": "qat", "library": None, "library_version": None, "hardware": False}


def test_software_fallback_does_not_exhaust_thread_keys():
    """libqatzip 1.3 leaks a pthread key per software call; kvtool deletes it (or stops calling QATzip)."""
    require_available("qat")
    script = """
import ctypes, gzip, sys
from kvtool.codecs import _qatzip, get_codec
lib = _qatzip.load()
if lib.hardware:
    sys.exit(0)  # a QAT device: QATzip initialises once and leaks nothing
libc = ctypes.CDLL(None)
codec, data = get_codec("qat"), bytes(range(256)) * 64
for _ in range(1100):
    assert gzip.decompress(codec.encode(data)) == data
key = ctypes.c_uint()
assert libc.pthread_key_create(ctypes.byref(key), None) == 0, "no pthread keys left"
print("reclaimed" if lib._reclaimer else "budget", key.value)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    if proc.stdout.startswith("reclaimed"):
        assert int(proc.stdout.split()[1]) < 64  # every call's key was given back
    elif proc.stdout:
        assert "writes the same gzip format with zlib" in proc.stderr


def test_spent_budget_writes_the_same_format(monkeypatch, caplog):
    """Where kvtool cannot give QATzip's leaked keys back, it stops calling QATzip after a budget."""
    require_available("qat")
    from kvtool.codecs import _qatzip, qat

    lib = _qatzip.load()
    if lib.hardware:
        return  # a QAT device leaks nothing and has no budget
    monkeypatch.setattr(lib, "_reclaimer", None)
    monkeypatch.setattr(lib, "software_calls", _qatzip_fallback.SOFTWARE_CALL_BUDGET)
    monkeypatch.setattr(qat, "_budget_logged", False)
    data = bytes(range(256)) * 300
    with caplog.at_level("WARNING", logger="kvtool.codecs"):
        encoded = get_codec("qat").encode(data)
    assert lib.software_calls == _qatzip_fallback.SOFTWARE_CALL_BUDGET  # QATzip was not called
    assert gzip.decompress(encoded) == data
    assert "leaks a thread key" in caplog.text


# --- one format id: gzip -------------------------------------------------------------


@pytest.mark.parametrize("spec", ["gzip:1", "qat:1", "isal:1"])
def test_every_gzip_encoder_writes_the_gzip_id(spec: str, data: bytes):
    require_available(spec)
    from kvtool.codecs import codec_from_config
    from kvtool.codecs.gzip import GzipCodec

    codec = get_codec(spec)
    assert codec.get_config() == {"id": "gzip", "level": 1}
    rebuilt = codec_from_config(codec.get_config())
    assert type(rebuilt) is GzipCodec and rebuilt == codec
    assert rebuilt.decode(codec.encode(data), max_size=len(data)) == data


def test_qat_and_isal_configs_of_older_files_still_decode(data: bytes):
    from kvtool.codecs import codec_from_config

    blob = gzip.compress(data, compresslevel=1)
    for config in ({"id": "qat", "level": 1, "hw_buffer_size": 65536}, {"id": "isal", "level": 3}):
        codec = codec_from_config(config)
        assert codec.decode(blob, max_size=len(data)) == data
        assert codec.get_config()["id"] == "gzip"


def test_gzip_encodes_with_the_fastest_encoder_here_and_says_which():
    from kvtool.codecs.gzip import GzipCodec

    rows = {row["id"]: row for row in json.loads(CliRunner().invoke(app, ["codecs", "--json"]).stdout)}
    try:
        hardware = _qatzip.load().hardware
    except Exception:
        hardware = False
    try:
        import isal  # noqa: F401

        expected = "qat" if hardware else "isal"
    except ImportError:
        expected = "qat" if hardware else "zlib"
    assert rows["gzip"]["available"] and rows["gzip"]["encoder"] == expected == GzipCodec.details()["encoder"]
    assert {"qat": "QAT hardware", "isal": "ISA-L", "zlib": "zlib"}[expected] in rows["gzip"]["implementation"]


# --- QATzip's software-fallback workarounds ------------------------------------------


ENCODE_THREE_TIMES = """
import sys, threading
from kvtool.codecs import get_codec
codec = get_codec("qat")
if sys.argv[1] == "second thread":
    stop = threading.Event()
    threading.Thread(target=stop.wait).start()
for _ in range(3):
    codec.encode(b"x" * 1000)
if sys.argv[1] == "second thread":
    stop.set()
print("hardware" if __import__("kvtool.codecs._qatzip").codecs._qatzip.load().hardware else "software")
"""


@pytest.mark.parametrize("setting, threads, filtered", [
    ("", "one thread", True), ("", "second thread", False), ("0", "one thread", False), ("1", "second thread", True),
])
def test_stderr_is_redirected_only_when_safe_or_asked(setting: str, threads: str, filtered: bool):
    """Pointing fd 2 elsewhere hides other threads' stderr: done alone, or when asked for."""
    require_available("qat")
    env = {**os.environ, _qatzip_fallback.FILTER_ENV_VAR: setting}
    proc = subprocess.run([sys.executable, "-c", ENCODE_THREE_TIMES, threads], env=env, capture_output=True, text=True, check=True)
    if proc.stdout.strip() == "hardware":
        pytest.skip("a QAT device: no software fallback, nothing printed")
    noisy = proc.stderr.count(_qatzip_fallback.PROBE_NOISE.decode())
    assert (noisy == 0) if filtered else (noisy >= 3), proc.stderr


def test_thread_keys_are_reclaimed_only_for_the_known_library_version():
    require_available("qat")
    lib = _qatzip.load()
    assert _qatzip_fallback.KeyReclaimer.attach(lib._cdll, "1.3.0") is None
    assert _qatzip_fallback.KeyReclaimer.attach(lib._cdll, None) is None
    if lib.hardware:
        return
    fixes = lib.workarounds()
    if lib.version == _qatzip_fallback.RECLAIM_VERSION and lib._reclaimer is not None:
        assert fixes["thread_keys"].startswith("deleted after each call")
    else:
        assert lib._reclaimer is None and f"zlib after {_qatzip_fallback.SOFTWARE_CALL_BUDGET} calls" in fixes["thread_keys"]
    rows = {row["id"]: row for row in json.loads(CliRunner().invoke(app, ["codecs", "--json"]).stdout)}
    assert rows["qat"]["thread_keys"] == fixes["thread_keys"] and "stderr filter" in rows["qat"]["implementation"]


def test_one_shot_commands_filter_the_probe_line_while_their_threads_run(tmp_path: Path):
    """`kvtool bench` runs qat on worker threads; a command's terminal still gets no probe lines."""
    require_available("qat")
    env = {k: v for k, v in os.environ.items() if k != _qatzip_fallback.FILTER_ENV_VAR}
    cache = Path(__file__).resolve().parents[1] / "samples" / "code.safetensors"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtool", "bench", str(cache), "-r", "qat", "--repeat", "1", "--threads", "2", "--no-peers"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _qatzip_fallback.PROBE_NOISE.decode() not in proc.stderr
