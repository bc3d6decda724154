"""Every probe of tests/fuzz/probes.py at a larger size: the counts BENCHMARKS.md records.

    python benchmarks/probe_count.py --mutations 2000 --ops 1000 --json

The crafted-file corpus, ``--mutations`` randomly mutated files, the bad command lines, a
damaged file store and ``--processes`` processes x ``--ops`` operations on one file store
below its working set; for each family the probes run and the count of each bad outcome
(wrong data, hangs over 10 s, tracebacks, crashes, memory over 512 MB, secrets printed, data
changed by look-only commands). Exit status 1 if any count is not 0.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fuzz"))

from probes import BAD, HANG_S, run_probes  # tests/fuzz is not a package: found through sys.path
from sandbox import Sandbox


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutations", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args()
    started = time.monotonic()
    box = Sandbox(memory=1 << 30, cpu_seconds=int(HANG_S), timeout=HANG_S + 5)
    try:
        with tempfile.TemporaryDirectory(prefix="kvtool-probes-") as tmp:
            families, found = run_probes(box, Path(tmp), args.mutations, args.seed, args.processes, args.ops)
    finally:
        box.close()
    result = {"families": families, "found": found, "seconds": round(time.monotonic() - started, 1), **vars(args)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'family':20} {'probes':>8} " + " ".join(f"{bad:>9}" for bad in BAD))
        for name, counts in families.items():
            print(f"{name:20} {counts['probes']:>8} " + " ".join(f"{counts[bad]:>9}" for bad in BAD))
        for item in found:
            print("found:", json.dumps(item))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
