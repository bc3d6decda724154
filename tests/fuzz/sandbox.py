"""Run untrusted-input cases in forked children under hard time and memory limits.

A *zygote* process (``python sandbox.py``) imports kvtool once, then serves one
JSON request per line on stdin: for each it forks a child that sets its limits
(``RLIMIT_AS`` = the zygote's address space + ``memory`` bytes, ``RLIMIT_CPU``),
runs the case and reports through a pipe. The zygote answers with the child's
report plus what it measured: wall and CPU seconds, the growth of its peak
resident memory, and how it ended. A child that outlives ``timeout`` seconds of
wall time is killed. Forking from a small, single-threaded process keeps each
case cheap (milliseconds) and isolated from pytest's own state.

Cases:

``{"op": "read", "path": P, "max_size": N}``
    ``read()`` through ``open_kvz``, ``sizes()`` and ``verify(full=True)``, and
    ``read()`` through ``KvzReader.from_bytes`` (the vLLM restore path), and
    ``read_rows()`` into a buffer of the cache's size, each on its own; report ``ok`` with a digest of the decoded bits and whether the
    decode agrees with the raw checksums the file records, or ``error`` with the
    kvtool error ``read()`` ended in; ``ops`` says how each way ended.
``{"op": "cli", "args": [...]}``
    run ``kvtool ARGS`` in-process; report the exit code and output.

Anything else escaping (``MemoryError``, ``RecursionError``, a numpy error) is
reported as ``bug`` with its traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

MiB = 1 << 20


class Sandbox:
    """The test side: starts a zygote and sends it cases."""

    def __init__(self, memory: int = 256 * MiB, cpu_seconds: int = 10, timeout: float = 30.0):
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.limits = {"memory": memory, "cpu_seconds": cpu_seconds, "timeout": timeout}
        self._proc = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        ready = self._proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the sandbox did not start: {ready!r}")

    def run(self, case: dict[str, Any]) -> dict[str, Any]:
        self._proc.stdin.write(json.dumps({**case, **self.limits}) + "\n")
        self._proc.stdin.flush()
        return json.loads(self._proc.stdout.readline())

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=30)


# -- the zygote ------------------------------------------------------------------------------


def _preload() -> None:
    """Import everything a case may touch, so children measure decoding, not imports."""
    import kvtool.api  # noqa: F401
    import kvtool.cli  # noqa: F401
    import typer.testing  # noqa: F401
    from kvtool.codecs import registry as codecs
    from kvtool.layouts import registry as layouts

    for registry in (codecs, layouts):
        for id_ in registry.ids():
            try:
                registry.get(id_)
            except Exception:  # an optional codec missing here; a case naming it gets a kvtool error
                pass
    runner = typer.testing.CliRunner()
    for command in ("verify", "inspect", "decompress"):  # Typer imports its option parsers on first use
        runner.invoke(kvtool.cli.app, [command, "/nonexistent", "/nonexistent", "--max-size", "1"])


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _serve() -> None:
    _preload()
    print("ready", flush=True)
    for line in sys.stdin:
        case = json.loads(line)
        print(json.dumps(_fork_case(case)), flush=True)


def _fork_case(case: dict[str, Any]) -> dict[str, Any]:
    base_rss = _status_kib("VmRSS") * 1024
    base_vm = _status_kib("VmSize") * 1024
    read_end, write_end = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: limits, the case, one report, exit
        os.close(read_end)
        try:
            limit = base_vm + case["memory"]
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            resource.setrlimit(resource.RLIMIT_CPU, (case["cpu_seconds"], case["cpu_seconds"] + 1))
            report = _run_case(case)
        except BaseException as exc:  # noqa: BLE001 - everything is reported, nothing escapes the child
            report = {"status": "bug", "type": type(exc).__name__, "traceback": traceback.format_exc()[-4000:]}
        with os.fdopen(write_end, "w") as out:
            out.write(json.dumps(report))
        os._exit(0)
    os.close(write_end)
    chunks, deadline, timed_out = [], start + case["timeout"], False
    with os.fdopen(read_end) as pipe:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                break
            ready, _, _ = select.select([pipe], [], [], left)
            if ready:
                data = os.read(pipe.fileno(), 1 << 20)
                if not data:
                    break
                chunks.append(data)
    _, status, usage = os.wait4(pid, 0)
    wall = time.monotonic() - start
    if timed_out:
        report = {"status": "timeout"}
    elif os.WIFSIGNALED(status):
        report = {"status": "killed", "signal": signal.Signals(os.WTERMSIG(status)).name}
    else:
        report = json.loads(b"".join(chunks) or b'{"status": "bug", "type": "no report"}')
    report.update(
        wall_s=round(wall, 4),
        child_cpu_s=round(usage.ru_utime + usage.ru_stime, 4),
        rss_growth=max(0, usage.ru_maxrss * 1024 - base_rss),
    )
    return report


def _run_case(case: dict[str, Any]) -> dict[str, Any]:
    if case["op"] == "read":
        return _read_case(Path(case["path"]), case["max_size"])
    if case["op"] == "cli":
        return _cli_case(case["args"])
    raise ValueError(f"unknown op {case['op']!r}")


def _read_case(path: Path, max_size: int) -> dict[str, Any]:
    """Every way of reading the file, each on its own: ``read`` first, as ``kvtool.load`` and vLLM do."""
    from kvtool.kvz import KvzReader, open_kvz

    outcomes: dict[str, Any] = {}
    started = time.process_time()
    with _outcome(outcomes, "read"):
        with open_kvz(path, max_size=max_size) as reader:
            cache = reader.read(threads=1)
            checked = _agrees_with_checksums(cache, reader.recipe, reader.chunk_tokens, reader.index)
    with _outcome(outcomes, "verify"):
        with open_kvz(path, max_size=max_size) as reader:
            reader.sizes()
            reader.verify(full=True)
    with _outcome(outcomes, "from_bytes"):
        with KvzReader.from_bytes(path.read_bytes(), max_size=max_size) as reader:
            again = reader.read(threads=1)
    with _outcome(outcomes, "read_rows"):
        with KvzReader.from_bytes(path.read_bytes(), max_size=max_size) as reader:
            placed = _read_rows(reader, max_size)
    report: dict[str, Any] = {"ops": outcomes, "cpu_s": time.process_time() - started}
    bugs = {op: o for op, o in outcomes.items() if o.get("bug")}
    if bugs:
        return {**report, "status": "bug", **next(iter(bugs.values()))}
    if outcomes["read"]["ok"]:
        return {
            **report,
            "status": "ok",
            "digest": digest(cache),
            "same_by_both_paths": outcomes["from_bytes"]["ok"] and digest(again) == digest(cache),
            "same_by_rows": outcomes["read_rows"]["ok"] and (placed is None or placed == _cache_bytes(cache)),
            "agrees_with_checksums": checked,
        }
    return {**report, "status": "error", **{k: outcomes["read"][k] for k in ("type", "decode_error", "message")}}


@contextlib.contextmanager
def _outcome(outcomes: dict[str, Any], op: str):
    """Record how ``op`` ended: ok, a kvtool error (its type), or a bug (its traceback)."""
    from kvtool.errors import DecodeError, KvtoolError

    try:
        yield
        outcomes[op] = {"ok": True}
    except KvtoolError as exc:
        outcomes[op] = {"ok": False, "type": type(exc).__name__, "decode_error": isinstance(exc, DecodeError), "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - anything else is what the harness looks for
        outcomes[op] = {"ok": False, "bug": True, "type": type(exc).__name__, "traceback": traceback.format_exc()[-4000:]}


def _read_rows(reader, max_size: int) -> bytes | None:
    """``read_rows`` into one flat buffer laid out as ``read()`` lays out a cache; None when the
    buffer and its row offsets would take more than ``max_size``."""
    import numpy as np

    count = 2 * len(reader.layer_ids)
    heads, tokens, dim = reader.tensors[0][2] if reader.tensors else (0, 0, 0)
    row = dim * reader.dtype.itemsize
    if count * heads * tokens * (row + 8) > max_size:
        return None  # data and row offsets (int64) over the limit: the rows path leaves the sizing to its caller
    target = np.zeros(max(count * heads * tokens * row, row, 1), np.uint8)
    rows = (np.arange(count * heads * tokens, dtype=np.int64) * row).reshape(count, heads, tokens)
    reader.read_rows([target], rows, [0] * count)
    return target[: count * heads * tokens * row].tobytes()


def _cache_bytes(cache) -> bytes:
    return b"".join(array.tobytes() for _, _, array in cache.tensors())


def digest(cache) -> str:
    """A hash of a cache's tensors, bit for bit, in order (shapes included, dtype names not)."""
    import hashlib

    h = hashlib.sha256()
    for _, kind, array in cache.tensors():
        h.update(f"{kind}{array.shape}".encode())
        h.update(array.view(f"u{array.itemsize}").tobytes())
    return h.hexdigest()


def _agrees_with_checksums(cache, recipe, chunk_tokens: int, index) -> bool:
    """Whether the decoded cache, cut again into the file's planes, has the raw lengths and hashes the file records."""
    from kvtool.codecs import get_codec
    from kvtool.kvz import KvzReader, encode_cache
    from kvtool.recipe import Recipe

    # Raw checksums come before any codec: the file's own codec (and its encoder settings) are not needed.
    plain = Recipe(recipe.layouts, get_codec("none"))
    with KvzReader.from_bytes(encode_cache(cache, plain, chunk_tokens=chunk_tokens, threads=1), max_size=1 << 62) as again:
        columns = ("tensor", "plane", "token_start", "token_count", "raw_len", "raw_xxh3")
        return all(bool((again.index[c] == index[c]).all()) for c in columns) and len(again.index) == len(index)


def _cli_case(args: list[str]) -> dict[str, Any]:
    from typer.testing import CliRunner

    from kvtool.cli import app

    result = CliRunner().invoke(app, args)
    unexpected = result.exception if not isinstance(result.exception, SystemExit) else None
    return {
        "status": "cli",
        "exit_code": result.exit_code,
        "stdout": result.stdout[-100_000:],
        "stderr": result.stderr[-2000:],
        "exception": None if unexpected is None else "".join(traceback.format_exception(unexpected))[-4000:],
    }


if __name__ == "__main__":
    _serve()
