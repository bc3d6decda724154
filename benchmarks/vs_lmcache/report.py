"""Tables (markdown) and a plot from the JSON that bench.py writes.

    python benchmarks/vs_lmcache/report.py benchmarks/results/vs_lmcache.json \
        --plot benchmarks/results/vs_lmcache.png > benchmarks/results/vs_lmcache.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

CONNECTORS = ("lmcache", "kvtool", "kvtool-none")
ORDER = ("vllm", "vllm-prefix", "vllm-prefix-mp", "lmcache", "kvtool", "kvtool-none")
# Top-level timers of the timed kvtool connector (the others are nested inside them).
KVTOOL_TOP = ("lookup", "restore", "layer_wait", "capture", "step_end", "save")
RESTORE_PHASES = ("fetch", "open", "decode", "restore")


def pct(values: list[float], q: float) -> float:
    """The q-quantile with linear interpolation (numpy's default)."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = (len(v) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def used_bytes(snap: dict[str, Any]) -> int | None:
    if snap.get("lmcache_storage"):
        return snap["lmcache_storage"]["l1_manager"]["memory_used_bytes"]
    store = (snap.get("kvtool") or {}).get("store")
    return store["used_bytes"] if store else None


def connector_cpu(snap: dict[str, Any]) -> float | None:
    if "connector_cpu_s" in snap:
        return snap["connector_cpu_s"]
    phases = (snap.get("kvtool") or {}).get("phases")
    if phases is None:
        return None
    return sum(phases.get(name, {}).get("cpu_s", 0.0) for name in KVTOOL_TOP)


def phase_delta(a: dict, b: dict, name: str, key: str) -> float:
    pa = ((a.get("kvtool") or {}).get("phases") or {}).get(name, {})
    pb = ((b.get("kvtool") or {}).get("phases") or {}).get(name, {})
    return pb.get(key, 0.0) - pa.get(key, 0.0)


def reference_outputs(runs: list[dict]) -> dict[tuple, dict[str, list[int]]]:
    """(repeat, workload, concurrency, turn, session) -> {config: output tokens} for the reference configs."""
    refs: dict[tuple, dict[str, list[int]]] = defaultdict(dict)
    for run in runs:
        for ph in run["phases"]:
            for r in ph["requests"]:
                key = (run["kind"], run["repeat"], ph["workload"], ph["concurrency"], r["turn"], r["session"])
                refs[key][run["config"]] = r["output"]
    return refs


def summarise(results: dict) -> dict[str, Any]:
    runs = results["runs"]
    per_token = results["kv_bytes_per_token"]
    outputs = reference_outputs(runs)
    ttft: dict[tuple, list[float]] = defaultdict(list)
    repeat_p50: dict[tuple, list[float]] = defaultdict(list)
    restored: dict[tuple, list[int]] = defaultdict(list)
    stored_before: dict[tuple, list[int]] = defaultdict(list)
    matches: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # same as own-mode prefix ref, n, same as recompute, n
    held: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # CPU seconds, restored bytes
    breakdown: dict[str, float] = defaultdict(float)
    restored_entries = 0
    for run in runs:
        cfg, kind = run["config"], run["kind"]
        for ph in run["phases"]:
            key = (kind, ph["workload"], ph["concurrency"], cfg)
            rows = ph["requests"]
            t = [r["ttft_s"] for r in rows]
            ttft[key] += t
            repeat_p50[key].append(statistics.median(t))
            restored[key] += [r["cached_tokens"] for r in rows]
            stored_before[key] += [r["stored_before"] for r in rows]
            own_ref = "vllm-prefix-mp" if run.get("multiprocessing") else "vllm-prefix"
            for r in rows:
                refs = outputs[(kind, run["repeat"], ph["workload"], ph["concurrency"], r["turn"], r["session"])]
                if own_ref in refs and cfg != own_ref:
                    matches[key][0] += refs[own_ref] == r["output"]
                    matches[key][1] += 1
                if "vllm" in refs and cfg != "vllm":
                    matches[key][2] += refs["vllm"] == r["output"]
                    matches[key][3] += 1
            if kind == "main" and cfg in CONNECTORS:
                start, before, after = ph["start"], ph["before"], ph["after"]
                if ph["workload"] == "agent" and used_bytes(after) is not None:
                    held[cfg].append((used_bytes(after) - used_bytes(start)) / ph["sessions"])
                c0, c1 = connector_cpu(start), connector_cpu(after)
                if c0 is not None and c1 is not None:
                    cpu[cfg][0] += c1 - c0
                    cpu[cfg][1] += sum(r["cached_tokens"] for r in rows) * per_token
                if cfg == "kvtool":
                    for name in RESTORE_PHASES:
                        breakdown[name] += phase_delta(before, after, name, "wall_s")
                        breakdown[name + ".cpu"] += phase_delta(before, after, name, "cpu_s")
                    restored_entries += phase_delta(before, after, "open", "calls")
    return {"ttft": ttft, "repeat_p50": repeat_p50, "restored": restored, "stored_before": stored_before,
            "matches": matches, "held": held, "cpu": cpu, "breakdown": breakdown,
            "restored_entries": restored_entries, "per_token": per_token}


def tables(results: dict, s: dict[str, Any]) -> str:
    out = []
    st = results["settings"]
    out.append(f"Settings: {json.dumps({k: st[k] for k in sorted(st) if k not in ('out', 'model', 'kvtool_python', 'lmcache_python')})}")
    out.append("")
    out.append("| workload | c | config | requests | TTFT p50 s | TTFT p90 s | p50 per repeat s | reused / stored tokens | outputs = prefix-cache ref | outputs = recompute |")
    out.append("|---|---:|---|---:|---:|---:|---|---:|---:|---:|")
    keys = sorted({k for k in s["ttft"] if k[0] == "main"}, key=lambda k: (k[1] != "shared", k[2], ORDER.index(k[3])))
    for key in keys:
        _, workload, c, cfg = key
        t = s["ttft"][key]
        m = s["matches"][key]
        rest, stored = sum(s["restored"][key]), sum(s["stored_before"][key])
        out.append(
            f"| {workload} | {c} | {cfg} | {len(t)} | {pct(t, 0.5):.2f} | {pct(t, 0.9):.2f} | "
            f"{' / '.join(f'{x:.2f}' for x in s['repeat_p50'][key])} | {rest} / {stored} | "
            f"{f'{m[0]}/{m[1]}' if m[1] else '-'} | {f'{m[2]}/{m[3]}' if m[3] else '-'} |"
        )
    out.append("")
    out.append("| config | bytes held per agent session | sessions kept per GiB | LMCache's bytes / these | connector CPU s per restored GB |")
    out.append("|---|---:|---:|---:|---:|")
    lm = statistics.mean(s["held"]["lmcache"]) if s["held"].get("lmcache") else None
    for cfg in CONNECTORS:
        if not s["held"].get(cfg):
            continue
        h = statistics.mean(s["held"][cfg])
        cpu_s, restored_bytes = s["cpu"][cfg]
        per_gb = f"{cpu_s / (restored_bytes / 1e9):.1f}" if restored_bytes else "-"
        out.append(f"| {cfg} | {h / 1e6:.2f} MB | {2**30 / h:.1f} | {f'{lm / h:.2f}x' if lm else '-'} | {per_gb} |")
    cap = sorted({k for k in s["ttft"] if k[0] == "capacity"}, key=lambda k: ORDER.index(k[3]))
    if cap:
        out.append("")
        budget = next(r["budget_gb"] for r in results["runs"] if r["kind"] == "capacity")
        out.append(f"Capacity: {st['capacity_sessions']} agent sessions, {st['agent_turns']} turns each, one budget of "
                   f"{budget} GiB for LMCache's L1 and for kvtool's memory store.")
        out.append("")
        out.append("| config | requests | hit rate (restored / stored tokens) | TTFT p50 s | TTFT p90 s | outputs = recompute |")
        out.append("|---|---:|---:|---:|---:|---:|")
        for key in cap:
            t = s["ttft"][key]
            rest, stored = sum(s["restored"][key]), sum(s["stored_before"][key])
            m = s["matches"][key]
            out.append(f"| {key[3]} | {len(t)} | {rest / stored:.0%} ({rest} / {stored}) | {pct(t, 0.5):.2f} | "
                       f"{pct(t, 0.9):.2f} | {f'{m[2]}/{m[3]}' if m[3] else '-'} |")
    b, n = s["breakdown"], s["restored_entries"]
    if n:
        out.append("")
        out.append(f"kvtool's restore path in the server (timed connector, main runs, {int(n)} entries restored), "
                   "ms per restored entry, wall / thread CPU:")
        out.append("")
        out.append("| phase | wall ms | CPU ms |")
        out.append("|---|---:|---:|")
        names = {"fetch": "fetch (store read)", "open": "open (fetch, record, .kvz header and index)",
                 "decode": "decode into paged blocks (checksums and copy included)",
                 "restore": "start_load_kv, whole restore"}
        for name in (n for n in RESTORE_PHASES if b[n]):  # a restore path uses some of them only
            out.append(f"| {names[name]} | {b[name] / n * 1e3:.2f} | {b[name + '.cpu'] / n * 1e3:.2f} |")
    return "\n".join(out)


def plot(s: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k for k in s["ttft"] if k[0] == "main"}, key=lambda k: (k[1] != "shared", k[2], ORDER.index(k[3])))
    groups = sorted({(k[1], k[2]) for k in keys}, key=lambda g: (g[0] != "shared", g[1]))
    configs = [c for c in ORDER if any(k[3] == c for k in keys)]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / len(configs)
    for i, cfg in enumerate(configs):
        xs, p50, p90 = [], [], []
        for g, (w, c) in enumerate(groups):
            t = s["ttft"].get(("main", w, c, cfg))
            if t:
                xs.append(g + i * width)
                p50.append(pct(t, 0.5))
                p90.append(pct(t, 0.9))
        ax.bar(xs, p50, width, label=cfg)
        ax.errorbar(xs, p50, yerr=[[0] * len(p50), [b - a for a, b in zip(p50, p90)]], fmt="none", ecolor="black", capsize=2)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], [f"{w}, c={c}" for w, c in groups])
    ax.set_ylabel("TTFT s (bar p50, whisker p90)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("Time to first token, vLLM 0.32 CPU, SmolLM2-135M")
    cfgs = [c for c in CONNECTORS if s["held"].get(c)]
    ax2.bar(cfgs, [2**30 / statistics.mean(s["held"][c]) for c in cfgs], color=["C3", "C4", "C5"][: len(cfgs)])
    ax2.set_ylabel("agent sessions kept per GiB")
    ax2.set_title("Sessions per GiB of store")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args()
    results = json.loads(args.results.read_text())
    s = summarise(results)
    print(tables(results, s))
    if args.plot:
        plot(s, args.plot)


if __name__ == "__main__":
    main()
