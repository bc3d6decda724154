"""Text tables and CSV rows from a bench ``Report``.

Throughput on a shared machine swings from run to run; ratios against the
baselines measured in the same run (``zstd:3``, ``lz4``) do not, so the table
shows compression speed relative to zstd:3 beside the absolute numbers.
"""

from __future__ import annotations

from typing import Any

from kvtool.bench.bounds import LABELS, LIMITS
from kvtool.bench.matrix import OK, FileReport, Report, Result

REFERENCE = "zstd:3"
#: The limit a recipe's "% of limit" is taken against. Per-channel mantissa tables over
#: few tokens fit the sample by chance, so the all-fields limit is loose on short caches.
HEADLINE_LIMIT = "sign_exp_per_channel"


def headline(file: FileReport) -> str:
    tensor = "x".join(map(str, file.shape))
    return (
        f"{file.path}: {file.dtype}, {file.layers} layers x K/V [{tensor}], "
        f"{file.raw_bytes / 1e6:.1f} MB"
    )


def limits_line(file: FileReport) -> str:
    parts = [f"{LABELS[name]} {file.limits['all'][name]:.3f}x" for name in LIMITS if file.limits["all"][name]]
    return "entropy limits (models free): " + " | ".join(parts)


#: Marks the recipe with the best ratio in a file's table.
WINNER = "*"


def legend(threads: int) -> list[str]:
    """What the table's columns mean, printed under the tables."""
    return [
        (f"{WINNER} the best lossless ratio for that file. ratio: original bytes / stored bytes (higher is better); "
         "K, V: the same for keys and for values alone."),
        (f"% limit: ratio as a share of the order-0 entropy limit with {LABELS[HEADLINE_LIMIT]} (100 = that limit); "
         "a coder that models each value in its context (ctxans) is not bound by an order-0 limit and can pass 100."),
        (f"comp/dec MB/s: MB (10^6 bytes) of original data per second on 1 thread; comp/dec {threads}t: on {threads} threads "
         "(below the 1-thread speed where the cores are few or busy with other work: the threads wait for them)."),
        f"vs {REFERENCE}: 1-thread compression speed relative to {REFERENCE} in the same run (2.00x = twice as fast).",
        "cpu s/GB c, d: CPU seconds (all threads) per GB of original data to compress, to decompress, on 1 thread.",
        "planes: ratio of each plane the recipe's layouts split the data into (hi/lo bytes, exponent, mantissa...).",
    ]


def table_rows(file: FileReport, threads: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows and column names of one file's table."""
    n = str(threads)
    limit = file.limits["all"].get(HEADLINE_LIMIT)
    reference = next((r for r in file.results if r.recipe == REFERENCE and r.status == OK), None)
    columns = ["recipe", "ratio", "% limit", "K", "V", "comp MB/s", f"comp {n}t", "dec MB/s", f"dec {n}t",
               "vs zstd:3", "cpu s/GB c", "cpu s/GB d", "planes"]
    best = max((r.ratio for r in file.results if r.status == OK and not r.lossy and r.ratio is not None), default=None)  # lossless
    rows: list[dict[str, Any]] = []
    for r in file.results:
        if r.status != OK:
            rows.append({"recipe": r.recipe, "planes": f"{r.status}: {r.reason}"})
            continue
        assert r.ratio is not None  # every measured result has its ratio
        rows.append({
            "recipe": f"{label(r)} {WINNER}" if r.ratio == best else label(r),
            "ratio": r.ratio,
            "% limit": round(100 * r.ratio / limit, 1) if limit and not r.lossy else "",  # a lossless limit
            "K": r.by_kind.get("k", ""),
            "V": r.by_kind.get("v", ""),
            "comp MB/s": r.compress_mbps["1"],
            f"comp {n}t": r.compress_mbps.get(n, r.compress_mbps["1"]),
            "dec MB/s": r.decompress_mbps["1"],
            f"dec {n}t": r.decompress_mbps.get(n, r.decompress_mbps["1"]),
            "vs zstd:3": f"{r.compress_mbps['1'] / reference.compress_mbps['1']:.2f}x" if reference and reference.compress_mbps["1"] else "",
            "cpu s/GB c": r.compress_cpu_s_per_gb,
            "cpu s/GB d": r.decompress_cpu_s_per_gb,
            "planes": " ".join(f"{p} {v:.2f}" for p, v in r.by_plane.items()),
        })
    return rows, columns


#: Decimals per column, fixed so a column reads the same in every run (a speed crossing 10 or 1000
#: would otherwise change them).
COLUMN_DECIMALS = {"ratio": 3, "K": 3, "V": 3, "% limit": 1, "comp MB/s": 1, "dec MB/s": 1,
                   "cpu s/GB c": 2, "cpu s/GB d": 2}


def column_decimals(threads: int) -> dict[str, int]:
    """``COLUMN_DECIMALS`` with the names of the ``threads``-thread columns too."""
    return {**COLUMN_DECIMALS, f"comp {threads}t": 1, f"dec {threads}t": 1}


def label(result: Result) -> str:
    """A result's recipe as tables and plots show it: a lossy one says so."""
    return f"{result.recipe} (lossy)" if result.lossy else result.recipe


CSV_COLUMNS = [
    "file", "dtype", "tokens", "recipe", "lossy", "status", "reason", "raw_bytes", "stored_bytes", "ratio", "ratio_k", "ratio_v",
    "compress_mbps_1t", "compress_mbps_nt", "decompress_mbps_1t", "decompress_mbps_nt", "threads",
    "compress_cpu_s_per_gb", "decompress_cpu_s_per_gb", *(f"limit_{name}" for name in LIMITS),
]


def csv_rows(report: Report) -> list[dict[str, Any]]:
    """One flat row per (file, recipe); per-layer and per-plane ratios are in the JSON only."""
    n = str(report.settings["threads"])
    rows = []
    for file in report.files:
        for r in file.results:
            rows.append({
                "file": file.path, "dtype": file.dtype, "tokens": file.tokens,
                "recipe": r.recipe, "lossy": r.lossy, "status": r.status, "reason": r.reason,
                "raw_bytes": r.raw_bytes, "stored_bytes": r.stored_bytes, "ratio": r.ratio,
                "ratio_k": r.by_kind.get("k"), "ratio_v": r.by_kind.get("v"),
                "compress_mbps_1t": r.compress_mbps.get("1"), "compress_mbps_nt": _at(r, "compress_mbps", n),
                "decompress_mbps_1t": r.decompress_mbps.get("1"), "decompress_mbps_nt": _at(r, "decompress_mbps", n),
                "threads": n, "compress_cpu_s_per_gb": r.compress_cpu_s_per_gb,
                "decompress_cpu_s_per_gb": r.decompress_cpu_s_per_gb,
                **{f"limit_{name}": file.limits["all"][name] for name in LIMITS},
            })
    return rows


def _at(result: Result, name: str, threads: str) -> float | None:
    speeds = getattr(result, name)
    return speeds.get(threads, speeds.get("1"))
