"""How long kvtool commands take from process start to their first output.

    python benchmarks/startup.py [--runs N] [--checkout DIR]

Runs each command N times in a fresh ``python -m kvtool`` process (with DIR on
PYTHONPATH, default this checkout) and prints, per command, the best wall time to
the first byte on stdout or stderr, the best wall time to exit, and the best CPU
time (user + system) of the process. On a shared machine the wall times carry other
processes' load; the CPU time does not.
"""

from __future__ import annotations

import argparse
import os
import resource
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commands(out: Path) -> dict[str, list[str]]:
    sample = str(ROOT / "samples" / "code.safetensors")
    return {
        "kvtool --help": ["--help"],
        "kvtool --version": ["--version"],
        "kvtool codecs": ["codecs"],
        "kvtool compress (5.6 MiB sample)": ["compress", sample, str(out / "code.kvz")],
        "kvtool verify": ["verify", str(out / "code.kvz")],
    }


def run_once(args: list[str], checkout: Path) -> tuple[float, float, float]:
    """(seconds to the first output, seconds to exit, CPU seconds) of one process."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "COLUMNS": "100"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvtool", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=checkout, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    first = None
    streams = [proc.stdout, proc.stderr]
    while streams:
        ready, _, _ = select.select(streams, [], [])
        for stream in ready:
            if not os.read(stream.fileno(), 65536):
                streams.remove(stream)
            elif first is None:
                first = time.perf_counter() - started
    code = proc.wait()
    total = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"kvtool {' '.join(args)} exited {code}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return first if first is not None else total, total, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--checkout", type=Path, default=ROOT)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'command':<34} {'first output s':>14} {'exit s':>8} {'CPU s':>7}   (best of {options.runs})")
        for name, args in commands(Path(tmp)).items():
            runs = [run_once(args, options.checkout.resolve()) for _ in range(options.runs)]
            print(f"{name:<34} {min(r[0] for r in runs):>14.3f} {min(r[1] for r in runs):>8.3f} "
                  f"{min(r[2] for r in runs):>7.3f}")


if __name__ == "__main__":
    main()
