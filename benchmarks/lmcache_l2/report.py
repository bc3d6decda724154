"""The tables of BENCHMARKS.md ("kvtool where offload is deployed") from one cell's JSON, each target met or missed.

    python benchmarks/lmcache_l2/report.py benchmarks/results/lmcache_l2_cold.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

PER_GB = ("store_cpu_s_per_gb", "load_cpu_s_per_gb", "load_wall_s_per_gb")
PER_CHUNK = ("store_wall_s_per_chunk", "load_cpu_s_per_chunk", "load_wall_s_per_chunk")
PART_NAMES = {"chunks": "LMCache L2 adapter", "decoder": "kvtool decoder alone", "tier": "vLLM offloading tier"}


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def chunk_table(rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """One row per configuration: medians over its repeats."""
    medians: dict[str, dict[str, Any]] = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        m: dict[str, Any] = {k: _median(mine, k) for k in (*PER_GB, *PER_CHUNK, "held_bytes", "resident_at_load")}
        m.update(part=mine[0]["part"], workers=mine[0].get("workers"), raw_bytes=mine[0]["raw_bytes"],
                 chunks=mine[0]["chunks"], repeats=len(mine), exact=all(r["bit_exact"] for r in mine))
        medians[config] = m
    lines = [("| part | config | workers | ratio | store CPU s/GB | store wall ms/chunk | load CPU s/GB | "
              "load CPU ms/chunk | load wall s/GB | load wall ms/chunk | cached at load | bit-exact |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for config, m in medians.items():
        cached = "-" if m["resident_at_load"] is None else f"{m['resident_at_load'] / 2**20:.1f} MiB"
        lines.append(
            f"| {PART_NAMES[m['part']]} | {config} | {m['workers'] or '-'} | {m['raw_bytes'] / m['held_bytes']:.3f}x | "
            f"{_num(m['store_cpu_s_per_gb'])} | {_ms(m['store_wall_s_per_chunk'])} | {_num(m['load_cpu_s_per_gb'])} | "
            f"{_ms(m['load_cpu_s_per_chunk'])} | {_num(m['load_wall_s_per_gb'])} | {_ms(m['load_wall_s_per_chunk'])} | "
            f"{cached} | {'yes' if m['exact'] else 'NO'} ({m['repeats']} x {m['chunks']}) |")
    return lines, medians


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _connector_restore(phase: dict[str, Any]) -> tuple[float, int]:
    """kvtool's connector: wall seconds of its restores in the phase (``start_load_kv``, from its memory tier or
    the L2 below it), and the entries it opened to restore."""
    before, after = phase["connector"]["before"], phase["connector"]["after"]

    def diff(name: str, key: str) -> float:
        return after.get(name, {}).get(key, 0) - before.get(name, {}).get(key, 0)
    return diff("restore", "wall_s"), int(diff("open", "calls"))


def reference_outputs(phases: list[dict[str, Any]]) -> dict[tuple[int, int, int], dict[str, Any]]:
    """vLLM's prefix cache's requests (output tokens, top candidates where recorded) by (concurrency, turn, session)."""
    return {(p["concurrency"], q["turn"], q["session"]): q
            for p in phases if p["config"] == "vllm-prefix" and "error" not in p for q in p["requests"]}


def divergence(request: dict[str, Any], reference: dict[str, Any]) -> str:
    """Where a request's output first differs from the reference's, and how far apart the two tokens were there.

    With top candidates recorded (``bench.py --logprobs``), the gap is the log-probability of the token a run chose
    less that of the other token, in either run's candidates: 0 is an exact tie, which batches composed otherwise
    may break either way on vLLM's CPU build; a wrong cache moves the distribution far more."""
    at = next(i for i, (a, b) in enumerate(zip(request["output"], reference["output"])) if a != b)
    where = f"session {request['session']} turn {request['turn']} at output token {at}"
    gaps = []
    for run, chosen, other in ((request, request["output"][at], reference["output"][at]),
                               (reference, reference["output"][at], request["output"][at])):
        candidates = dict((int(t), lp) for t, lp in run["top"][at]) if len(run.get("top") or ()) > at else {}
        if chosen in candidates and other in candidates:
            gaps.append(candidates[chosen] - candidates[other])
    return where + (f" ({max(gaps):.3f} nats apart)" if gaps else " (no log-probabilities recorded)")


#: Settings that decide a trace's prompts and outputs: a reference from another cell's run holds only if they agree.
TRACE_SETTINGS = ("model", "sessions", "turns", "context", "output_tokens", "seed")


def trace_cells(phases: list[dict[str, Any]],
                reference: dict[tuple[int, int, int], dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    cells = {}
    for p in phases:
        if "error" in p:
            continue
        requests = p["requests"]
        restored = [q for q in requests if q["cached_tokens"] > 0]
        compared = [q for q in restored if (p["concurrency"], q["turn"], q["session"]) in reference]
        differ = [divergence(q, ref) for q in compared
                  if (ref := reference[(p["concurrency"], q["turn"], q["session"])])["output"] != q["output"]]
        if p.get("connector"):
            l2_seconds, entries = _connector_restore(p)
            tasks = None
        else:
            l2_seconds, tasks = sum(t["seconds"] for t in p["l2_loads"]), len(p["l2_loads"])
            entries = sum(t.get("loaded", 0) for t in p["l2_loads"])
        stored_before = sum(q["stored_before"] for q in requests)
        restored_tokens = sum(q["cached_tokens"] for q in requests)
        held = p["l2_disk_bytes"]
        counters = ((p.get("l2_adapters") or [{}])[0].get("counters") or {})
        if held is None and counters.get("stored_bytes") is not None:
            held = counters["stored_bytes"]
        cells[(p["config"], p["concurrency"])] = {
            "requests": len(requests), "ttft_p50": statistics.median(q["ttft_s"] for q in requests),
            "restored_requests": len(restored), "restored_tokens": restored_tokens,
            "hit_rate": restored_tokens / stored_before if stored_before else None,
            "l2_tasks": tasks, "l2_seconds": l2_seconds,
            "l2_per_restored": l2_seconds / len(restored) if restored else None,
            "l2_chunks": entries, "held": held,
            "same": len(compared) - len(differ), "differ": differ, "of": len(compared), "restored_of": len(restored),
            "reference": p["config"] == "vllm-prefix",
            "resident_after_drop": p.get("resident_after_drop") or [],
        }
    return cells


def trace_table(cells: dict[tuple[str, int], dict[str, Any]]) -> list[str]:
    lines = [("| config | c | requests | TTFT p50 s | L2 loads (chunks) | L2 load per restored session ms | "
              "tokens restored | hit rate | L2 bytes at end | cached after drops | outputs = vLLM prefix cache |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for (config, c), x in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0] == "vllm-prefix")):
        loads = "-" if x["reference"] else f"{'-' if x['l2_tasks'] is None else x['l2_tasks']} ({x['l2_chunks']})"
        per = "-" if x["l2_per_restored"] is None or x["reference"] else f"{x['l2_per_restored'] * 1e3:.1f}"
        held = "-" if x["held"] is None else f"{x['held'] / 2**20:.1f} MiB"
        resident = [r for r in x["resident_after_drop"] if r is not None]
        cached = f"{max(resident) / 2**20:.2f} MiB" if resident else "-"
        check = ("(reference)" if x["reference"] else f"{x['same']} of {x['of']} restored" if x["of"] == x["restored_of"]
                 else f"{x['same']} of {x['of']} compared ({x['restored_of']} restored)")
        hit = "-" if x["hit_rate"] is None else f"{x['hit_rate']:.0%}"
        lines.append(f"| {config} | {c} | {x['requests']} | {x['ttft_p50']:.3f} | {loads} | {per} | "
                     f"{x['restored_tokens']} | {hit} | {held} | {cached} | {check} |")
    return lines


def _target(name: str, met: bool, value: str) -> str:
    return f"- {name}: {'met' if met else 'MISSED'} ({value})"


def _below(kv: float, base: float) -> str:
    """How far ``kv`` is below ``base``, or above it."""
    if not base:
        return "-"
    return f"{1 - kv / base:.1%} below" if kv <= base else f"{kv / base - 1:.1%} above"


def targets(cell: str, chunks: dict[str, dict[str, Any]], cells: dict[tuple[str, int], dict[str, Any]]) -> list[str]:
    out = []
    k, f = chunks.get("kvtool"), chunks.get("fs")
    if k is not None:
        ratio = k["raw_bytes"] / k["held_bytes"]
        out.append(_target("adapter's whole load <= 0.35 CPU s/GB, ratio >= 1.50",
                           k["load_cpu_s_per_gb"] <= 0.35 and ratio >= 1.50,
                           f"{k['load_cpu_s_per_gb']:.2f} CPU s/GB at {ratio:.3f}x"))
    if k is not None and f is not None and cell == "warm":
        out.append(_target("warm: load wall per chunk with the adapter's workers <= 2x fs",
                           k["load_wall_s_per_chunk"] <= 2 * f["load_wall_s_per_chunk"],
                           f"{k['load_wall_s_per_chunk'] * 1e3:.1f} vs {f['load_wall_s_per_chunk'] * 1e3:.1f} ms"))
    pairs = {"warm": ("kvtool", "fs"), "cold": ("kvtool", "fs"), "capacity": ("kvtool", "fs")}
    for c in sorted({c for _, c in cells}):
        for kv_name, base_name in ([pairs[cell]] if cell in pairs else
                                   [(n, n.replace("kvtool-redis", "kvtool-redis-none")) for n, cc in cells
                                    if cc == c and n.startswith("kvtool-redis@")]):
            kv, base = cells.get((kv_name, c)), cells.get((base_name, c))
            if kv is None or base is None:
                continue
            tag = f"{cell} c={c}" + (f" {kv_name.split('@')[1]} Gbit/s" if "@" in kv_name else "")
            ttft = f"{kv['ttft_p50']:.3f} vs {base['ttft_p50']:.3f} s"
            if cell == "capacity":
                more = kv["restored_tokens"] / base["restored_tokens"] if base["restored_tokens"] else float("inf")
                out.append(_target(f"{tag}: >= 1.4x tokens restored", more >= 1.4,
                                   f"{kv['restored_tokens']} vs {base['restored_tokens']}, {more:.2f}x"))
                out.append(_target(f"{tag}: TTFT p50 >= 10% below fs", kv["ttft_p50"] <= 0.9 * base["ttft_p50"],
                                   f"{ttft}, {_below(kv['ttft_p50'], base['ttft_p50'])}"))
            else:
                out.append(_target(f"{tag}: TTFT p50 <= {base_name}'s", kv["ttft_p50"] <= base["ttft_p50"], ttft))
            need = {"cold": 0.20, "remote": 0.25}.get(cell)
            if need is not None and "@25" not in kv_name:
                a, b = kv["l2_per_restored"], base["l2_per_restored"]
                if a is not None and b:
                    out.append(_target(f"{tag}: L2 load per restored session >= {need:.0%} below {base_name}'s",
                                       a <= (1 - need) * b, f"{a * 1e3:.1f} vs {b * 1e3:.1f} ms, {_below(a, b)}"))
        conn, lm = cells.get(("kvtool-connector", c)), cells.get(("fs", c))
        if conn is not None and lm is not None:
            out.append(_target(f"{cell} c={c}: kvtool's connector TTFT p50 <= LMCache's (fs L2)",
                               conn["ttft_p50"] <= lm["ttft_p50"], f"{conn['ttft_p50']:.3f} vs {lm['ttft_p50']:.3f} s"))
    for (config, c), x in sorted(cells.items()):
        if not x["reference"] and x["of"] < x["restored_of"]:
            out.append(f"- {config} c={c}: outputs = vLLM's prefix cache: NOT COMPARED on {x['restored_of'] - x['of']} "
                       f"of {x['restored_of']} restored requests (no reference output for them)")
        elif not x["reference"]:
            out.append(_target(f"{config} c={c}: outputs = vLLM's prefix cache on every restored request",
                               x["same"] == x["of"], "; ".join([f"{x['same']} of {x['of']}", *x["differ"]])))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("--reference", type=Path, default=None,
                   help="another cell's JSON whose vLLM prefix-cache outputs to compare with, where this run has none "
                        "(the same model and trace settings)")
    args = p.parse_args()
    data = json.loads(args.results.read_text())
    reference = reference_outputs(data.get("trace", []))
    reference_note = []
    if not reference and args.reference is not None:
        other = json.loads(args.reference.read_text())
        differ = [k for k in TRACE_SETTINGS if other["settings"].get(k) != data["settings"].get(k)]
        if differ:
            p.error(f"{args.reference} ran another trace ({', '.join(differ)} differ): its outputs are no reference")
        reference = reference_outputs(other.get("trace", []))
        reference_note = [(f"No vLLM prefix-cache run in this cell's run: outputs compared with the one of cell "
                           f"`{other['cell']}` ({other['started']}), the same model and trace.")]
    lines = [f"Cell `{data['cell']}`, {data['started']} to {data.get('finished', '(unfinished)')}, "
             f"{data['cpus']} CPUs shared with other work; load average (1, 5, 15 min) before and after each part: "
             + "; ".join(f"{x['part']}{x['label']} {x['before']} -> {x['after']}" for x in data["load"]) + "."]
    if data.get("budget_bytes"):
        lines.append(f"Budget of every L2: {data['budget_bytes'] / 2**20:.1f} MiB "
                     f"({data['settings']['budget_fraction']:.0%} of the raw bytes one phase's sessions store).")
    for link in data.get("links", []):
        lines.append(f"Link shaped to {link['gbit']:g} Gbit/s (MTU {link['mtu']}): a bulk transfer reached "
                     + " and ".join(f"{g:.1f}" for g in link["measured_gbit"]) + " Gbit/s before and after.")
    for failed in (p for p in data.get("trace", []) if "error" in p):
        lines.append(f"**{failed['config']}" + (f" c={failed['concurrency']}" if "concurrency" in failed else "")
                     + f" did not finish**: {failed['error'][:300]}")
    chunk_lines, chunks = chunk_table(data.get("chunks", [])) if data.get("chunks") else ([], {})
    cells = trace_cells(data.get("trace", []), reference)
    print("\n".join([*lines, *reference_note, "", *chunk_lines, "", *(trace_table(cells) if cells else []), "",
                     *targets(data["cell"], chunks, cells)]))


if __name__ == "__main__":
    main()
