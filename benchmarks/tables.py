"""Markdown tables for BENCHMARKS.md from `kvtool bench --json` reports.

    python benchmarks/tables.py out/bench-*.json > out/tables.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LIMITS = {
    "values": "whole values",
    "byte_planes": "byte planes",
    "sign_exp_per_channel": "sign+exp per channel, mantissa raw",
    "fields_per_channel": "every field per channel",
    "sign_level_per_channel": "sign+exp+top mantissa bit per channel",
    "sign_level_context": "the same in ctxans's 16 contexts",
}


def esc(recipe: str) -> str:
    """A recipe inside a markdown table cell: its pipes escaped."""
    return recipe.replace("|", "\\|")


def speed_vs(result: dict, reference: dict | None, key: str) -> str:
    if not reference:
        return ""
    return f"{result[key]['1'] / reference[key]['1']:.2f}"


def tables(report: dict, name: str) -> list[str]:
    s, m = report["settings"], report["machine"]
    n = str(s["threads"])
    lines = [f"### {name}", "", f"{m['cpu']}, {m['cores']} cores; chunks of {s['chunk_tokens']} tokens; "
             f"best of {s['repeat']}; MB/s of original data; speed ratios are compress (c) and decompress (d) "
             f"speed over zstd:3's and lz4's in the same run, one thread.", ""]
    for file in report["files"]:
        limits = file["limits"]
        lines.append(f"**{Path(file['path']).name}** ({file['dtype']}, {file['tokens']} tokens, "
                     f"{file['raw_bytes'] / 1e6:.1f} MB). Entropy limits (models free), all / K / V: "
                     + "; ".join(f"{label} {limits['all'][key]:.3f} / {limits['k'][key]:.3f} / {limits['v'][key]:.3f}"
                                 for key, label in LIMITS.items() if limits["all"].get(key)))
        lines.append("")
        lines.append(f"| recipe | ratio | K | V | c MB/s | c {n}t | d MB/s | d {n}t | c/zstd:3 | d/zstd:3 | c/lz4 | d/lz4 | CPU s/GB c / d |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        ok = {r["recipe"]: r for r in file["results"] if r["status"] == "ok"}
        zstd = ok.get("zstd:3") or ok.get("peer: zstd:3 frame")
        lz4 = ok.get("lz4") or ok.get("peer: lz4 frame")
        for r in file["results"]:
            if r["status"] != "ok":
                lines.append(f"| `{esc(r['recipe'])}` | {r['status']}: {r['reason']} |||||||||||| ")
                continue
            c, d = r["compress_mbps"], r["decompress_mbps"]
            k, v = (f"{r['by_kind'][kind]:.3f}" if kind in r["by_kind"] else "" for kind in "kv")  # peers: whole blocks
            lines.append(
                f"| `{esc(r['recipe'])}` | {r['ratio']:.4f} | {k} | {v} "
                f"| {c['1']:.0f} | {c.get(n, c['1']):.0f} | {d['1']:.0f} | {d.get(n, d['1']):.0f} "
                f"| {speed_vs(r, zstd, 'compress_mbps')} | {speed_vs(r, zstd, 'decompress_mbps')} "
                f"| {speed_vs(r, lz4, 'compress_mbps')} | {speed_vs(r, lz4, 'decompress_mbps')} "
                f"| {r['compress_cpu_s_per_gb']:.2f} / {r['decompress_cpu_s_per_gb']:.2f} |"
            )
        lines.append("")
    return lines


def main(paths: list[str]) -> None:
    for path in paths:
        print("\n".join(tables(json.loads(Path(path).read_text()), Path(path).stem)))


if __name__ == "__main__":
    main(sys.argv[1:])
