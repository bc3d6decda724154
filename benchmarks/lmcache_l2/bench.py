"""kvtool where it plugs in as an L2, against LMCache's own ``fs`` adapter and raw storage, one cell at a time.

    .venv-lmcache/bin/python benchmarks/lmcache_l2/bench.py --cell cold --out benchmarks/results/lmcache_l2_cold.json

``run.sh CELL`` beside this file builds what is missing and prints the tables. A cell
(``cells.py``: ``warm``, ``cold``, ``capacity``, ``remote``) is where the L2 is
deployed; each runs up to four parts, side by side in one run, in LMCache 0.5.6's
environment (with vLLM's CPU build 0.32.0):

- ``chunks`` (``chunk_part.py``): each LMCache L2 adapter alone as LMCache's server drives it,
  per chunk and per GB, and kvtool's decoder alone on the same chunks;
- ``tier`` (``tier_part.py``): the same per-chunk store and load through a secondary tier of
  vLLM's own offloading: kvtool's (a recipe, or ``none``) and vLLM's ``fs`` tier;
- ``trace`` (``trace_part.py``): ``lmcache server`` + vLLM with ``LMCacheMPConnector``, one
  configuration per L2, kvtool's own connector over the same two levels, and vLLM's
  prefix cache as the reference; TTFT, L2 load time per restored session, tokens
  restored, bytes held, outputs compared;
- ``reference``: vLLM's prefix cache alone on the trace's prompts, once after the other
  parts. Left out (``--parts chunks,tier,trace``), ``report.py --reference`` compares the
  outputs with another cell's reference run of the same trace.

The remote cell runs every part once per link rate (``--link-gbit``), across a Redis
server in a network namespace (``link.py``, needs root). The results record the
machine's load average before and after each part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import chunk_part
import tier_part
import trace_part
from cells import CELLS, REFERENCE, Cell, Place
from link import Link

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "vs_lmcache"))
import bench as vs


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def budget_bytes(cell: Cell, args: argparse.Namespace) -> int:
    """The capacity cell's L2 budget: a share of the raw bytes one phase's sessions store (whole chunks)."""
    if not cell.budgeted:
        return 0
    raw_chunk = vs.kv_bytes_per_token(args.model) * vs.CHUNK
    return int(args.budget_fraction * args.sessions * (args.context // vs.CHUNK) * raw_chunk)


def run_parts(cell: Cell, args: argparse.Namespace, workdir: Path, place_of: Callable[[str], Place],
              results: dict[str, Any], save: Callable[[], None], label: str = "") -> None:
    """The cell's parts at one placement (one link rate in the remote cell), the reference left out."""
    parts = args.parts.split(",")
    steps: list[tuple[str, Callable[[], list]]] = []
    if "chunks" in parts and cell.chunks:
        steps.append(("chunks", lambda: chunk_part.adapters(cell.chunks, args.repeats, args.chunks, cell.cold,
                                                        place_of, label)))
    if "chunks" in parts and cell.chunks and not label:
        steps.append(("decoder", lambda: chunk_part.decoder(("exphuff", "none"), args.repeats, args.chunks)))
    if "tier" in parts and cell.tiers:
        steps.append(("tier", lambda: tier_part.run(cell.tiers, args.repeats, args.chunks, cell.cold, place_of, label)))
    configs = tuple(c for c in cell.trace if c != REFERENCE and (args.configs is None or c in args.configs))
    if "trace" in parts:
        steps.append(("trace", lambda: asyncio.run(trace_part.run(cell, configs, args, workdir, place_of, label))))
    for part, step in steps:
        before = load_average()
        rows = step()
        results["trace" if part == "trace" else "chunks"].extend(rows)
        results["load"].append({"part": part, "label": label, "before": before, "after": load_average()})
        save()


def main() -> None:
    args = parse_args()
    cell = CELLS[args.cell]
    workdir = Path(tempfile.mkdtemp(prefix=f"lmcache-l2-{cell.name}-"))
    print(f"cell {cell.name}: work and servers' logs in {workdir}", flush=True)
    results: dict[str, Any] = {"cell": cell.name, "settings": {k: vs.shown(v) for k, v in vars(args).items()},
                               "budget_bytes": budget_bytes(cell, args), "cpus": os.cpu_count(), "chunks": [],
                               "trace": [], "links": [], "load": [], "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results))

    with ExitStack() as stack:
        if cell.remote:
            link = stack.enter_context(Link())
            link.set_mtu(args.mtu)
            port = vs.free_port()
            link.start_redis(port, workdir / "redis.log")

            def remote(label: str) -> Place:
                link.flush_redis(port)
                return Place(redis=f"redis://{link.remote_ip}:{port}/0")

            for gbit in args.link_gbit:
                link.shape(gbit)
                measured = [link.measure()]
                run_parts(cell, args, workdir, remote, results, save, label=f"@{gbit:g}")
                measured.append(link.measure())
                results["links"].append({"gbit": gbit, "mtu": args.mtu, "measured_gbit": measured})
                save()
        else:
            budget = results["budget_bytes"]
            run_parts(cell, args, workdir, lambda label: Place(folder=workdir / label, budget_bytes=budget),
                      results, save)
    if "reference" in args.parts.split(","):
        before = load_average()
        results["trace"].extend(asyncio.run(trace_part.run(cell, (REFERENCE,), args, workdir, lambda _: Place())))
        results["load"].append({"part": "reference", "label": "", "before": before, "after": load_average()})
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cell", choices=sorted(CELLS), default="warm")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/lmcache_l2_CELL.json")
    p.add_argument("--parts", default="chunks,tier,trace,reference")
    p.add_argument("--configs", type=lambda s: s.split(","), default=None,
                   help="trace part: only these of the cell's configurations (default: all)")
    p.add_argument("--chunks", type=int, default=16, help="chunks per store and load (chunk and tier parts)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of the chunk and tier parts")
    p.add_argument("--model", type=Path, default=ROOT / "out" / "smollm2-135m")
    p.add_argument("--python", default=sys.executable, help="LMCache's environment's python")
    p.add_argument("--l1-gb", type=float, default=0.1, help="LMCache's L1 (and the connector's memory tier): "
                   "less than the sessions need")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--context", type=int, default=1024, help="tokens of a session's last turn")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--logprobs", type=int, default=0,
                   help="record each output token's top N candidates, so report.py can tell a tie from a wrong cache")
    p.add_argument("--settle", type=float, default=3.0, help="seconds after each round, for stores to finish")
    p.add_argument("--budget-fraction", type=float, default=0.6,
                   help="capacity cell: each L2's bytes, as a share of the raw bytes one phase's sessions store")
    p.add_argument("--link-gbit", type=lambda s: [float(x) for x in s.split(",")], default=[10.0, 25.0],
                   help="remote cell: link rates, Gbit/s each way")
    p.add_argument("--mtu", type=int, default=65000, help="remote cell: the link's MTU")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.out = args.out or ROOT / "benchmarks" / "results" / f"lmcache_l2_{args.cell}.json"
    return args


if __name__ == "__main__":
    main()
