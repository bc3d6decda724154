"""A differential torture of kvtool's tier under vLLM's OffloadingConnector, with vLLM's own file tier as the oracle.

    .venv-vllm/bin/python benchmarks/torture_tier.py --seed 7 --ops 10000 --json

Two of vLLM's tiering managers (vLLM's real CPU tier, spec and factory:
``kvtool.testing.offload``) get the same seeded random sequence of operations:
one over kvtool's tier, one over vLLM's own ``fs`` tier. The operations:
store a run of chunks (vLLM's CPU tier evicts to make room: a chunk then lives
in the secondary tier only), fetch a chunk (vLLM's lookup, a promotion from the
secondary tier, the read of the row vLLM names), drop a chunk from both
secondary tiers, reset vLLM's cache (``reset_cache`` drains the tiers' jobs),
restart both managers over the same stores (an empty CPU tier), and, as faults
of kvtool's store only, a stored entry bit-flipped or truncated on disk. The
model shape, KV layout (LBNHC/LBHNC), tensor-parallel layout (one worker, two
sharded, or two sharing one replicated copy), kvtool's store (a file tier, or
a memory tier over one) and recipe are drawn from the seed.

Every chunk read from either manager is compared byte for byte with what was
stored (``wrong``: must be 0). Before a fetch both tiers finish their jobs; where
both secondary tiers then hold the chunk, both fetches must hit (``hit_mismatch``:
must be 0); a chunk kvtool's store lost to a fault is a miss of kvtool's, counted
apart, never wrong bytes. The last line printed is one JSON object (``--json``) or
a table; the exit status is 1 when anything was wrong.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
from torture import report

ROOT = Path(__file__).resolve().parents[1]
OPS = {"store": 30, "fetch": 50, "drop": 6, "damage": 3, "truncate": 3, "reset": 1, "restart": 1}
RECIPES = ("exphuff", "zstd:3", "byteplane|lz4")


def choose(rng: random.Random) -> dict:
    """What the seed draws: KV layout, parallel layout, kvtool's store and recipe, CPU tier size."""
    workers = rng.choice([1, 2])
    layout = rng.choice(["LBNHC", "LBHNC"])
    return {"layout": layout, "workers": workers, "replicated": workers > 1 and rng.random() < 0.5,
            "head_dim": rng.choice([64, None]) if layout == "LBNHC" else 64,
            "store": rng.choice(["file", "memory,file"]), "recipe": rng.choice(RECIPES),
            "primary": rng.randrange(3, 7)}


class Pair:
    """The same operations on two managers: kvtool's tier (``mine``) and vLLM's file tier (``theirs``)."""

    def __init__(self, work: Path, draw: dict) -> None:
        from kvtool.testing.offload import Shape, kvtool_tier, vllm_file_tier

        self.shape = Shape(layout=draw["layout"], workers=draw["workers"], replicated=draw["replicated"])
        url = f"file://{work / 'kvtool'}"
        if draw["store"] == "memory,file":
            url = f"memory://?capacity={4 * self.shape.chunk_bytes},{url}"
        options = {"recipe": draw["recipe"], **({} if draw["head_dim"] else {"head_dim": None})}
        self.tiers = {"mine": {k: v for k, v in kvtool_tier(url, **options).items() if v is not None},
                      "theirs": vllm_file_tier(str(work / "vllm-fs"))}
        self.primary = draw["primary"]
        self.kvtool_dir = work / "kvtool"
        self.open()

    def open(self) -> None:
        from kvtool.testing.offload import Scheduler, tiering_spec

        self.engines = {name: Scheduler(tiering_spec(self.shape, [tier], self.primary))
                        for name, tier in self.tiers.items()}

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()

    @property
    def kvtool(self):
        return self.engines["mine"].tiers[0]

    @property
    def vllm_fs(self):
        return self.engines["theirs"].tiers[0]

    def settle(self) -> None:
        """Both tiers' jobs done (kvtool's copies stored too) and collected by vLLM."""
        self.kvtool.wait_stored()
        for engine in self.engines.values():
            engine.settle()

    def holds(self, key: bytes) -> dict[str, bool]:
        """Whether each secondary tier holds the chunk now."""
        return {"mine": self.kvtool.store.contains(self.kvtool.namer.key(key)),
                "theirs": os.path.exists(self.vllm_fs.file_mapper.get_file_name(key))}

    def drop(self, key: bytes) -> None:
        self.kvtool.store.delete(self.kvtool.namer.key(key))
        try:
            os.remove(self.vllm_fs.file_mapper.get_file_name(key))
        except FileNotFoundError:
            pass

    def damage(self, key: bytes, rng: random.Random, truncate: bool) -> bool:
        """Bit-flip or truncate kvtool's file of a stored chunk (the file tier's, below any memory tier)."""
        self.kvtool.store.flush()
        name = self.kvtool.namer.key(key).encode()
        for path in (self.kvtool_dir / "entries").rglob("*.kve"):
            data = path.read_bytes()
            if name not in data[:512]:
                continue
            if truncate:
                os.truncate(path, len(data) // 2)
            else:
                at = rng.randrange(len(data))
                with open(path, "r+b") as f:
                    f.seek(at)
                    f.write(bytes([data[at] ^ (1 << rng.randrange(8))]))
            return True
        return False


def run(args: argparse.Namespace) -> dict:
    import kvtool
    from vllm.v1.kv_offload.base import LookupResult

    from kvtool.testing.offload import offload_key, row_bytes

    rng = random.Random(args.seed)
    draw = choose(rng)
    work = Path(tempfile.mkdtemp(prefix="kvtool-tier-torture-"))
    sample = kvtool.load(ROOT / "samples" / "code.safetensors")
    pair = Pair(work, draw)
    truth = {n: row_bytes(sample, n, pair.shape) for n in range(args.keys)}
    tally: Counter[str] = Counter()
    lost: set[int] = set()  # chunks kvtool's store may have lost to a fault since they were last stored
    kinds, weights = zip(*OPS.items())
    started = time.monotonic()
    try:
        for number in range(args.ops):
            op = rng.choices(kinds, weights)[0]
            tally[f"op_{op}"] += 1
            if op == "store":
                first = rng.randrange(args.keys)
                names = [(first + i) % args.keys for i in range(rng.randrange(1, 4))]
                for engine in pair.engines.values():
                    engine.store([offload_key(n) for n in names], [truth[n] for n in names])
                lost.difference_update(n for n in names if not pair.holds(offload_key(n))["mine"])
            elif op == "fetch":
                n = rng.randrange(args.keys)
                key = offload_key(n)
                pair.settle()
                held = pair.holds(key)
                got = {name: engine.fetch(key, truth[n].size) for name, engine in pair.engines.items()}
                for name, (found, data) in got.items():
                    if found is LookupResult.HIT:
                        tally[f"hits_{name}"] += 1
                        if not np.array_equal(data, truth[n]):
                            tally[f"wrong_{name}"] += 1
                hits = {name: found is LookupResult.HIT for name, (found, _) in got.items()}
                if held["mine"] and held["theirs"]:
                    tally["both_held"] += 1
                    if hits["mine"] != hits["theirs"]:
                        tally["lost_to_faults" if n in lost else "hit_mismatch"] += 1
                elif hits["mine"] != hits["theirs"]:
                    tally[f"held_only_by_{'mine' if hits['mine'] else 'theirs'}"] += 1
            elif op == "drop":
                pair.settle()
                pair.drop(offload_key(rng.randrange(args.keys)))
            elif op in ("damage", "truncate"):
                pair.settle()
                n = rng.randrange(args.keys)
                if pair.damage(offload_key(n), rng, truncate=op == "truncate"):
                    tally[f"fault_{op}"] += 1
                    lost.add(n)
            elif op == "reset":
                for engine in pair.engines.values():
                    engine.manager.reset_cache()
            else:
                pair.close()
                pair.open()
            if args.progress and (number + 1) % args.progress == 0:
                print(f"{number + 1}/{args.ops} ops, {dict(tally)}, {time.monotonic() - started:.0f} s",
                      file=sys.stderr, flush=True)
    finally:
        pair.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    wrong = tally["wrong_mine"] + tally["wrong_theirs"]
    return {"seed": args.seed, "ops": args.ops, "keys": args.keys, **draw, "wrong": wrong,
            "hit_mismatch": tally["hit_mismatch"], **dict(sorted(tally.items())),
            "seconds": round(time.monotonic() - started, 1), **({"work": str(work)} if args.keep else {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000, help="operations seed (printed)")
    parser.add_argument("--ops", type=int, default=2000, help="random operations, each on both managers")
    parser.add_argument("--keys", type=int, default=40, help="distinct chunks the operations pick from")
    parser.add_argument("--progress", type=int, default=0, help="a line on stderr every N operations")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (stores)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args(argv)
    print(f"tier torture: seed {args.seed}, {args.ops} operations", file=sys.stderr, flush=True)
    result = run(args)
    report(result, args.json)
    return 1 if result["wrong"] or result["hit_mismatch"] else 0


if __name__ == "__main__":
    sys.exit(main())
