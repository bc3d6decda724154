"""A reader that runs out of memory ends in a kvtool error (exit status 4), never a raw ``MemoryError``.

Each case runs in a child whose address space is capped (``RLIMIT_AS``) a little above what it
has mapped once kvtool is imported, and reads a valid file whose cache is larger than that cap,
with ``max_size`` and ``max_expansion`` raised so that only memory stops it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from make_corpus import claim, zstd_zeros

#: One layer whose K and V are 32 MiB of zeros each, in one zstd chunk per tensor: a valid file.
BIG = claim([8, 32768, 64], 32768, zstd_zeros)
HEADROOM = 24 << 20  # the cap: this much address space beyond what the child holds before reading

CHILD = r"""
import json, resource, sys
import numpy as np
import kvtool
from kvtool.cli import app
from kvtool.kvz import KvzReader, open_kvz
from typer.testing import CliRunner

path, op, headroom = sys.argv[1], sys.argv[2], int(sys.argv[3])
limits = dict(max_size=1 << 34, max_expansion=1 << 30)
if op == "read_rows":  # the caller's memory, there before the cap: only the reader's own is capped
    heads, tokens, dim = 8, 32768, 64
    rows = (np.arange(2 * heads * tokens, dtype=np.int64) * dim * 2).reshape(2, heads, tokens)
    target = np.zeros(2 * heads * tokens * dim * 2, np.uint8)
mapped = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize:")).split()[1]) << 10
resource.setrlimit(resource.RLIMIT_AS, (mapped + headroom, resource.RLIM_INFINITY))
try:
    if op == "load":
        kvtool.load(path, threads=1, **limits)
    elif op == "from_bytes":
        KvzReader.from_bytes(open(path, "rb").read(), **limits).read(threads=1)
    elif op == "read_rows":
        with open_kvz(path, **limits) as reader:
            reader.read_rows([target], rows, [0, 0])
    else:
        out = CliRunner().invoke(app, [op, path, *sys.argv[4:], "--max-size", "16GiB", "--max-expansion", "1000000000"])
        print(json.dumps({"exit": out.exit_code, "output": out.output,
                          "exception": None if out.exception is None or isinstance(out.exception, SystemExit)
                          else type(out.exception).__name__}))
        sys.exit(0)
except MemoryError:
    print(json.dumps({"raised": "MemoryError"}))
except kvtool.errors.KvtoolError as exc:
    print(json.dumps({"raised": type(exc).__name__, "exit_code": exc.exit_code, "message": str(exc)}))
else:
    print(json.dumps({"raised": None}))
"""


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("memory") / "big.kvz"
    path.write_bytes(BIG())
    return path


def run_capped(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, *args], check=False, capture_output=True, text=True, timeout=120,
                          env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": ":".join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("op", ["load", "from_bytes", "read_rows"])
def test_out_of_memory_is_a_kvtool_error(big, op):
    report = run_capped(str(big), op, str(HEADROOM))
    assert report["raised"] == "KvzTooLargeError" and report["exit_code"] == 4, report
    assert "out of memory" in report["message"], report
    assert report["message"].startswith("<bytes>" if op == "from_bytes" else str(big)), report


def test_out_of_memory_with_room_to_spare_reads(big):
    """The same child with room enough reads the file: the cap, not the file, made the error."""
    assert run_capped(str(big), "load", str(1 << 30)) == {"raised": None}


@pytest.mark.parametrize("command", [["verify", "--full"], ["decompress"]])
def test_the_cli_exits_4_in_one_line(big, tmp_path, command):
    args = [str(tmp_path / "out.safetensors")] if command[0] == "decompress" else command[1:]
    report = run_capped(str(big), command[0], str(HEADROOM), *args)
    assert report["exception"] is None and report["exit"] == 4, report
    last = report["output"].splitlines()[-1]  # (tqdm may warn first that it cannot start its monitor thread)
    assert last.startswith("kvtool: error: ") and "out of memory" in last and "Traceback" not in report["output"], report
