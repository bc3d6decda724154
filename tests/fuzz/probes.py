"""Every probe, counted: crafted files, mutated files, bad command lines, store faults, concurrency.

``run_probes(sandbox, work, mutations=N)`` runs each probe in the sandbox (a forked child under
``RLIMIT_AS`` and a wall-clock limit) or, for the concurrency probe, in worker processes, and
returns for each family the number of probes and of each bad outcome (``BAD``):

- ``wrong``: data handed back that is not what was stored (a read that decodes a file to
  something its own checksums deny, or two read paths that disagree; a store value that is
  not the one put);
- ``hang``: a probe past ``HANG_S`` of wall time (the sandbox kills it at its timeout);
- ``traceback``: an exception that is not a kvtool error, or a command that printed one;
- ``crash``: a child ended by a signal, or a worker that exited without its report;
- ``memory``: more than ``MEMORY`` bytes of resident memory, or running out of memory under it
  without the caller having raised a limit;
- ``secret``: a password given to a command appearing in what it printed;
- ``changed``: a look-only command (inspect, verify, store ls/stats) that changed a byte of
  what it looked at.

tests/fuzz/test_probes.py asserts every count is 0 at a CI size; benchmarks/probe_count.py
runs more mutations and prints the table that BENCHMARKS.md records.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

from kvtool.testing.shared import run_processes, summary

HERE = Path(__file__).parent
SAMPLE = HERE.parents[1] / "samples" / "code.safetensors"
BAD = ("wrong", "hang", "traceback", "crash", "memory", "secret", "changed")
HANG_S = 10.0
MEMORY = 512 << 20
#: ``max_size`` of the library readers: the rows path's caller sizes its own buffer by it, and a
#: caller that allocates 16 GiB (the default) for a file claiming that much is not kvtool's doing.
READ_LIMIT = 256 << 20
SECRET = "s3cret-Pa55word"  # given to commands as a Redis password; must never be printed


def new_counts() -> dict[str, int]:
    return {"probes": 0, **{bad: 0 for bad in BAD}}


def _tally(counts: dict[str, int], report: dict[str, Any], found: list[dict[str, Any]], probe: str) -> None:
    """Count one sandbox report; every bad outcome is also listed in ``found`` with its probe."""
    counts["probes"] += 1
    bad = []
    status = report.get("status")
    if status == "timeout" or report.get("wall_s", 0) > HANG_S:
        bad.append("hang")
    if status == "killed":
        bad.append("crash")
    if status == "bug" or report.get("exception") or "Traceback" in report.get("stderr", "") + report.get("stdout", ""):
        bad.append("traceback")
    out_of_memory = "out of memory" in str(report.get("message", "")) + report.get("stderr", "")
    if report.get("rss_growth", 0) > MEMORY or out_of_memory:
        bad.append("memory")
    if status == "ok" and not (report["same_by_both_paths"] and report["same_by_rows"] and report["agrees_with_checksums"]):
        bad.append("wrong")
    if SECRET in json.dumps(report):
        bad.append("secret")
    for kind in bad:
        counts[kind] += 1
    if bad:
        found.append({"probe": probe, "bad": bad, "report": {k: str(v)[:300] for k, v in report.items()}})


def _digest(path: Path) -> str:
    """A hash over every file under ``path`` (or the file itself): names, then bytes."""
    h = hashlib.sha256()
    for p in sorted([path] if path.is_file() else path.rglob("*")):
        if p.is_file() and not p.name.startswith("index."):  # the index database may checkpoint; its entries are the files
            h.update(str(p.relative_to(path.parent)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _look(sandbox, counts, found, probe: str, args: list[str], looked_at: Path) -> dict[str, Any]:
    before = _digest(looked_at)
    report = sandbox.run({"op": "cli", "args": args})
    _tally(counts, report, found, probe)
    if _digest(looked_at) != before:
        counts["changed"] += 1
        found.append({"probe": probe, "bad": ["changed"], "report": {}})
    return report


def files_probe(sandbox, work: Path, files: list[Path], found: list) -> dict[str, int]:
    """Each file through every reader and through the CLI with its default limits."""
    counts = new_counts()
    for path in files:
        _tally(counts, sandbox.run({"op": "read", "path": str(path), "max_size": READ_LIMIT}), found, f"read {path.name}")
        _look(sandbox, counts, found, f"inspect {path.name}", ["inspect", str(path), "--json"], path)
        _look(sandbox, counts, found, f"verify {path.name}", ["verify", str(path), "--full", "--threads", "1"], path)
        out = work / "decompressed.safetensors"
        report = sandbox.run({"op": "cli", "args": ["decompress", str(path), str(out), "--threads", "1"]})
        _tally(counts, report, found, f"decompress {path.name}")
        out.unlink(missing_ok=True)
    return counts


def mutated_files(work: Path, count: int, seed: int) -> list[Path]:
    """``count`` copies of a valid file, each with a few random bytes changed, cut or inserted."""
    from kvtool.cache import KVCache
    from kvtool.kvz import encode_cache

    rng = random.Random(seed)
    cache = KVCache.load(SAMPLE, layers=[0, 1], tokens=slice(0, 48))
    bases = [encode_cache(cache, recipe, chunk_tokens=16, threads=1) for recipe in ("byteplane|zstd:1", "exphuff", "none")]
    folder = work / "mutated"
    folder.mkdir(exist_ok=True)
    paths = []
    for i in range(count):
        blob = bytearray(rng.choice(bases))
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(blob))
            edit = rng.random()
            if edit < 0.6:
                blob[at] ^= 1 << rng.randrange(8)
            elif edit < 0.8:
                del blob[at: at + rng.randrange(1, 64)]
            else:
                blob[at:at] = rng.randbytes(rng.randrange(1, 16))
        path = folder / f"m{i:05d}.kvz"
        path.write_bytes(bytes(blob))
        paths.append(path)
    return paths


def cli_probe(sandbox, work: Path, found: list) -> dict[str, int]:
    """Bad command lines: missing and odd paths, bad numbers, bad store URLs, passwords that must stay hidden."""
    counts = new_counts()
    kvz = work / "good.kvz"
    nothing = work / "nothing-here"
    dir_link = work / "dir-link"
    if not dir_link.exists():
        dir_link.symlink_to(work)
    unreachable = f"redis://:{SECRET}@127.0.0.1:1/0?timeout=0.2&connect_timeout=0.2"
    cases = [
        ["compress", str(nothing), str(work / "x.kvz")],
        ["compress", str(SAMPLE), str(dir_link)],
        ["compress", str(SAMPLE), str(work / "y.kvz"), "--threads", "100000"],
        ["compress", str(SAMPLE), str(work / "z.kvz"), "--recipe", "no-such-codec:9"],
        ["compress", str(SAMPLE), str(work / "z.kvz"), "--chunk-tokens", "0"],
        ["decompress", str(kvz), str(work / "o.safetensors"), "--max-size", "-1"],
        ["decompress", str(kvz), str(work / "o.safetensors"), "--max-size", "1e400"],
        ["verify", str(work)],
        ["inspect", "/dev/null"],
        ["store", "get", "k", "--store", unreachable],
        ["store", "put", "k", str(kvz), "--store", unreachable],
        ["store", "ls", "--store", unreachable],
        ["store", "stats", "--store", unreachable],
        ["store", "evict", "k", "--store", unreachable],
        ["store", "ls", "--store", f"redis://:{SECRET}@127.0.0.1:1/x"],
        ["store", "ls", "--store", f"redis://:{SECRET}@127.0.0.1:1/0?timeout=1e400"],
        ["store", "ls", "--store", f"nosuch://:{SECRET}@host/0"],
        ["store", "ls", "--store", f"file://{work}/s?capacity=-5"],
    ]
    for args in cases:
        _tally(counts, sandbox.run({"op": "cli", "args": args}), found, " ".join(args)[:120])
    return counts


def store_probe(sandbox, work: Path, found: list) -> dict[str, int]:
    """A file store whose entries are damaged, replaced by a FIFO, or missing: misses, never wrong bytes or a hang."""
    from kvtool.store import open_store

    counts = new_counts()
    root = work / "faulty-store"
    shutil.rmtree(root, ignore_errors=True)
    url = f"file://{root}"
    values = {f"key-{i}": os.urandom(2000 + 97 * i) for i in range(8)}
    with open_store(url) as store:
        for key, value in values.items():
            store.put(key, value)
        paths = {key: store.path_of(key) for key in values}  # type: ignore[attr-defined]
    damage = ["truncate", "bitflip", "delete", "fifo", "empty", "directory", "bitflip", "none"]
    for (key, path), how in zip(paths.items(), damage):
        if how == "truncate":
            os.truncate(path, path.stat().st_size // 3)
        elif how in ("bitflip",):
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x10
            path.write_bytes(bytes(data))
        elif how == "delete":
            path.unlink()
        elif how == "fifo":
            path.unlink()
            os.mkfifo(path)
        elif how == "empty":
            path.write_bytes(b"")
        elif how == "directory":
            path.unlink()
            path.mkdir()
    for key, value in values.items():
        got = work / "got"
        got.unlink(missing_ok=True)
        report = sandbox.run({"op": "cli", "args": ["store", "get", key, "--store", url, "--output", str(got)]})
        _tally(counts, report, found, f"store get {key}")
        if report.get("exit_code") == 0 and got.read_bytes() != value:
            counts["wrong"] += 1
            found.append({"probe": f"store get {key}", "bad": ["wrong"], "report": {}})
    for verb in ("ls", "stats"):
        _look(sandbox, counts, found, f"store {verb}", ["store", verb, "--store", url, "--json"], root)
    return counts


def concurrency_probe(work: Path, processes: int, ops: int, found: list) -> dict[str, int]:
    """Processes on one file store below its working set: each counts wrong values and failed operations."""
    counts = new_counts()
    root = work / "shared-store"
    shutil.rmtree(root, ignore_errors=True)
    try:
        reports = run_processes(f"file://{root}?capacity={512 * 1024}", processes, ops, timeout=120)
    except Exception as exc:  # noqa: BLE001 - a worker that died is what this counts
        counts["probes"] += processes
        counts["crash"] += 1
        found.append({"probe": "concurrency", "bad": ["crash"], "report": {"error": str(exc)[:300]}})
        return counts
    total = summary(reports)
    counts["probes"] += total["ops"]
    counts["wrong"] += total["wrong"]
    counts["traceback"] += total["failures"]  # a failed operation is an exception or a refused put
    if total["wrong"] or total["failures"]:
        found.append({"probe": "concurrency", "bad": ["wrong" if total["wrong"] else "traceback"],
                      "report": {"failures": [f for r in reports for f in r["failures"]][:5]}})
    return counts


def run_probes(sandbox, work: Path, mutations: int = 0, seed: int = 0, processes: int = 3,
               ops: int = 200) -> tuple[dict[str, dict[str, int]], list[dict[str, Any]]]:
    """The counts per probe family, and every bad outcome found."""
    from kvtool.cache import KVCache
    from kvtool.kvz import encode_cache

    work.mkdir(parents=True, exist_ok=True)
    (work / "good.kvz").write_bytes(encode_cache(KVCache.load(SAMPLE, layers=[0], tokens=slice(0, 32)), "byteplane|zstd:1",
                                                 chunk_tokens=16, threads=1))
    found: list[dict[str, Any]] = []
    families = {
        "crafted files": files_probe(sandbox, work, sorted((HERE / "corpus").glob("*.kvz")), found),
        "bad command lines": cli_probe(sandbox, work, found),
        "store faults": store_probe(sandbox, work, found),
        "concurrency": concurrency_probe(work, processes, ops, found),
    }
    if mutations:
        families["mutated files"] = files_probe(sandbox, work, mutated_files(work, mutations, seed), found)
    return families, found
