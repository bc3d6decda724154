"""kvtool.load of a .kvz against safetensors' own loader of the raw file, all in page cache.

    python benchmarks/load_bench.py out/code-4096.safetensors [more.safetensors ...] [--repeat 7] [--json]

For each cache: the raw safetensors file loaded by ``safetensors.numpy.load_file``,
then ``kvtool.load`` of the same cache written as a .kvz with each recipe, on one
thread and on all cores. Every file is read once before timing, so all runs read
from the page cache. Reported per GB of original data: CPU seconds (the least of
the repeats; ``time.process_time``, all threads) and wall-clock GB/s, and each
kvtool load's speed as a fraction of safetensors' in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import ml_dtypes  # noqa: F401  (safetensors' numpy loader needs the bfloat16 name registered)
import safetensors.numpy

import kvtool
from kvtool.cache import KVCache

RECIPES = ("exphuff", "none", "channel-major|byteplane|zstd:huff,lo=none")


def best(run, repeat: int) -> tuple[float, float]:
    """Least wall and least CPU seconds over ``repeat`` runs."""
    walls, cpus = [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus)


def measure(path: Path, repeat: int, workdir: Path) -> list[dict]:
    cache = KVCache.load(path)
    gigabytes = cache.nbytes / 1e9
    runs = {"safetensors load_file": lambda: safetensors.numpy.load_file(str(path))}
    for recipe in RECIPES:
        kvz = workdir / f"{path.stem}.{len(runs)}.kvz"
        kvtool.save(cache, kvz, recipe=recipe)
        assert kvtool.load(kvz).equal_bits(cache)
        runs[f"kvtool.load {recipe}, 1 thread"] = lambda kvz=kvz: kvtool.load(kvz, threads=1)
        runs[f"kvtool.load {recipe}, {os.cpu_count()} threads"] = lambda kvz=kvz: kvtool.load(kvz)
    rows = []
    for name, run in runs.items():
        run()  # into the page cache
        wall, cpu = best(run, repeat)
        rows.append({"file": str(path), "load": name, "cpu_s_per_gb": round(cpu / gigabytes, 3),
                     "gb_per_s": round(gigabytes / wall, 3)})
    reference = rows[0]
    for row in rows:
        row["speed_vs_safetensors"] = round(row["gb_per_s"] / reference["gb_per_s"], 2)
        row["cpu_vs_safetensors"] = round(reference["cpu_s_per_gb"] / row["cpu_s_per_gb"], 2)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("caches", nargs="+", type=Path)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for path in args.caches for row in measure(path, args.repeat, Path(tmp))]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| file | load | CPU s/GB | GB/s | speed vs safetensors | CPU vs safetensors |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {Path(r['file']).name} | {r['load']} | {r['cpu_s_per_gb']} | {r['gb_per_s']} | "
              f"{r['speed_vs_safetensors']}x | {r['cpu_vs_safetensors']}x |")


if __name__ == "__main__":
    main()
