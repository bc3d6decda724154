"""The tables of BENCHMARKS.md ("kvtool as LMCache's L2") from bench.py's JSON, with each target met or missed.

    python benchmarks/lmcache_l2/report.py benchmarks/results/lmcache_l2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

CHUNK_COLUMNS = ("disk_bytes", "store_cpu_s_per_gb", "store_wall_s_per_gb", "load_cpu_s_per_gb", "load_wall_s_per_gb",
                 "load_wall_s_per_chunk")


def chunk_table(rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, dict[str, float]]]:
    medians: dict[str, dict[str, float]] = {}
    for adapter in dict.fromkeys(r["adapter"] for r in rows):
        mine = [r for r in rows if r["adapter"] == adapter]
        medians[adapter] = {c: statistics.median(r[c] for r in mine) for c in CHUNK_COLUMNS}
        medians[adapter]["raw_bytes"] = mine[0]["raw_bytes"]
        medians[adapter]["chunks"] = mine[0]["chunks"]
        medians[adapter]["exact"] = all(r["bit_exact"] for r in mine)
        medians[adapter]["repeats"] = len(mine)
    lines = [("| L2 adapter | ratio (raw / on disk) | store CPU s/GB | store wall s/GB | load CPU s/GB | load wall s/GB "
              "| loads bit-exact |"), "|---|---|---|---|---|---|---|"]
    for adapter, m in medians.items():
        lines.append(f"| {adapter} | {m['raw_bytes'] / m['disk_bytes']:.3f}x | {m['store_cpu_s_per_gb']:.2f} | "
                     f"{m['store_wall_s_per_gb']:.2f} | {m['load_cpu_s_per_gb']:.2f} | {m['load_wall_s_per_gb']:.2f} | "
                     f"{'yes' if m['exact'] else 'NO'} ({m['repeats']} x {m['chunks']} chunks) |")
    return lines, medians


def _stored_chunks(run: dict[str, Any]) -> int | None:
    """Chunks the adapter has stored so far (kvtool counts them; the fs adapter's come from its bytes)."""
    counters = (run["l2_adapters"] or [{}])[0].get("counters") or {}
    stored = [v for k, v in counters.items() if k.startswith("chunks_stored")]
    return int(sum(stored)) if stored else None


def trace_table(runs: list[dict[str, Any]], chunks_per_session: int) -> tuple[list[str], dict[tuple[str, int], dict[str, Any]]]:
    """One row per config and concurrency. L2 bytes per session: bytes per chunk the phase stored (a config's phases
    share one server and store, so a phase's share is what it added), times the chunks of a session's last turn
    (LMCache stores fewer chunks when its small L1 is full, and not the same number for both adapters)."""
    reference = {(r["concurrency"], q["turn"], q["session"]): q["output"]
                 for r in runs if r["config"] == "vllm-prefix" for q in r["requests"]}
    counted = [r for r in runs if _stored_chunks(r)]
    raw_chunk = (counted[0]["l2_adapters"][0]["counters"]["stored_raw_bytes"] / _stored_chunks(counted[0])
                 if counted else None)
    cells: dict[tuple[str, int], dict[str, Any]] = {}
    held: dict[str, tuple[float, float]] = {}
    lines = [("| config | concurrency | requests | TTFT p50 s | tokens restored | L2 chunks stored | L2 bytes per "
              f"session ({chunks_per_session} chunks) | outputs = vLLM prefix cache |"), "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        requests = run["requests"]
        restored = [q for q in requests if q["cached_tokens"] > 0]
        same = [q for q in restored if reference.get((run["concurrency"], q["turn"], q["session"])) == q["output"]]
        per_session = stored = None
        if run["l2_disk_bytes"] is not None and raw_chunk:
            total_chunks = _stored_chunks(run) or round(run["l2_disk_bytes"] / raw_chunk)
            bytes_before, chunks_before = held.get(run["config"], (0, 0))
            stored = total_chunks - chunks_before
            if stored:
                per_session = (run["l2_disk_bytes"] - bytes_before) / stored * chunks_per_session
            held[run["config"]] = (run["l2_disk_bytes"], total_chunks)
        cell = {"ttft_p50": statistics.median(q["ttft_s"] for q in requests), "per_session": per_session,
                "restored": sum(q["cached_tokens"] for q in restored), "same": len(same), "of": len(restored)}
        cells[(run["config"], run["concurrency"])] = cell
        shown = "-" if per_session is None else f"{per_session / 2**20:.1f} MiB"
        check = "(reference)" if run["config"] == "vllm-prefix" else f"{len(same)} of {len(restored)} restored"
        lines.append(f"| {run['config']} | {run['concurrency']} | {len(requests)} | {cell['ttft_p50']:.3f} | "
                     f"{cell['restored']} | {'-' if stored is None else stored} | {shown} | {check} |")
    return lines, cells


def targets(chunks: dict[str, dict[str, float]], cells: dict[tuple[str, int], dict[str, Any]]) -> list[str]:
    out = []
    if "kvtool" in chunks and "fs" in chunks:
        k, f = chunks["kvtool"], chunks["fs"]
        out.append(_target("L2 load wall per chunk <= fs", k["load_wall_s_per_chunk"] <= f["load_wall_s_per_chunk"],
                           f"{k['load_wall_s_per_chunk'] * 1e3:.1f} ms vs {f['load_wall_s_per_chunk'] * 1e3:.1f} ms"))
        out.append(_target("store CPU per GB <= 2x fs", k["store_cpu_s_per_gb"] <= 2 * f["store_cpu_s_per_gb"],
                           f"{k['store_cpu_s_per_gb']:.2f} vs {f['store_cpu_s_per_gb']:.2f} s/GB"))
    for concurrency in sorted({c for _, c in cells}):
        k, f = cells.get(("kvtool", concurrency)), cells.get(("fs", concurrency))
        if k is None or f is None:
            continue
        if k["per_session"] and f["per_session"]:
            ratio = f["per_session"] / k["per_session"]
            out.append(_target(f"L2 bytes per session >= 1.45x fewer (c={concurrency})", ratio >= 1.45, f"{ratio:.3f}x"))
        out.append(_target(f"TTFT p50 <= fs (c={concurrency})", k["ttft_p50"] <= f["ttft_p50"],
                           f"{k['ttft_p50']:.3f} vs {f['ttft_p50']:.3f} s"))
        out.append(_target(f"outputs = vLLM's prefix cache on every restored request (c={concurrency})",
                           k["same"] == k["of"] and k["of"] > 0, f"{k['same']} of {k['of']}"))
    return out


def _target(name: str, met: bool, value: str) -> str:
    return f"- {name}: {'met' if met else 'MISSED'} ({value})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", type=Path)
    data = json.loads(p.parse_args().results.read_text())
    chunk_lines, chunks = chunk_table(data.get("chunks", []))
    chunks_per_session = data["settings"]["context"] // data["settings"].get("chunk_tokens", 256)
    trace_lines, cells = trace_table(data.get("trace", []), chunks_per_session)
    print("\n".join([*chunk_lines, "", *trace_lines, "", *targets(chunks, cells)]))


if __name__ == "__main__":
    main()
