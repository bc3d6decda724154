"""A differential torture test of kvtool's vLLM connector.

    .venv-vllm/bin/python benchmarks/torture.py --seed 7 --requests 500 --json

A seeded random workload (sessions with shared and private prefixes, several tenants by
``cache_salt``, prompts that end mid-entry and mid-block, concurrent requests, a KV space
small enough that vLLM preempts) runs twice on vLLM's CPU build in the same process mode:
once through vLLM's own prefix cache (the reference), once with kvtool's connector over a
file store (and, when ``redis-server`` is installed, a Redis Cluster below it and a single
Redis below that), with faults injected between saves and restores (benchmarks/torture_faults.py):
entries deleted, truncated or bit-flipped, the file tier filled to its capacity, Redis
killed and restarted, a cluster master SIGKILLed (its replica takes over; it comes back as a
replica), the engine SIGKILLed and started again over the same store, and a second engine
opening the same store URL (one file folder, one cluster, one Redis) serving half a round. Block size and entry
size are drawn from the seed, so runs differ.

Every kvtool output is compared with the reference's for the same prompt in the same
batch. vLLM's own greedy output can depend on the position its computation starts from
(what its prefix cache held; kvtool restores whole entries where vLLM's cache hits whole
blocks), but only where two candidate tokens are nearly tied: both runs record their top
log-probabilities, and a difference whose first differing tokens are within ``NEAR_TIE``
of each other in both runs is vLLM's own (``vllm_own``); any other is ``wrong``. A
restore that handed the model another prompt's or damaged KV changes the distribution
far beyond that. Each difference is listed with both outputs and the gap.
The last line printed is one JSON object (with ``--json``) or a table.
"""


import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from torture_faults import Cluster, Faults, Redis

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ROOT / "samples" / "texts"
ENGINE = Path(__file__).with_name("torture_engine.py")
FAULTS = ("delete", "truncate", "bitflip", "tier_full", "redis_restart", "cluster_master_kill", "engine_kill",
          "second_engine")
SERVER_FAULTS = ("redis_restart", "cluster_master_kill")  # these need redis-server
TENANTS = (None, "tenant-a", "tenant-b")


@dataclass(frozen=True)
class Prompt:
    text: str
    salt: str | None


@dataclass
class Round:
    """One step of the workload: a fault injected first (or none), then batches run at once."""

    fault: str | None
    batches: list[list[Prompt]]


@dataclass
class Tally:
    requests: int = 0
    restored_requests: int = 0
    restored_tokens: int = 0
    recomputed_after_fault: int = 0
    wrong: int = 0
    vllm_own: int = 0
    second_engine_restored: int = 0
    preemptions: int = 0
    faults: dict[str, int] = field(default_factory=lambda: {kind: 0 for kind in FAULTS})


def build_workload(rng: random.Random, requests: int, concurrency: int, fault_rate: float,
                   faults: tuple[str, ...], max_chars: int = 5000) -> list[Round]:
    """Sessions over shared system prefixes; each turn appends to its session's prompt (its last
    ``max_chars`` characters are kept: shorter prompts make a request cheaper to prefill)."""
    texts = [p.read_text() for p in sorted(TEXTS.glob("*.txt"))]
    shared = [t[: rng.randrange(min(1500, max_chars // 2), min(4000, max_chars))] for t in texts]
    sessions: list[tuple[str | None, str]] = []
    rounds: list[Round] = []
    made = 0
    cycle: list[str] = []
    while made < requests:
        batch: list[Prompt] = []
        for _ in range(min(concurrency, requests - made)):
            if not sessions or rng.random() < 0.3:
                base = rng.choice(shared) if rng.random() < 0.8 else ""
                sessions.append((rng.choice(TENANTS), base))
            i = rng.randrange(len(sessions))
            salt, text = sessions[i]
            source = rng.choice(texts)
            start = rng.randrange(0, len(source) - 800)
            text = (text + "\n\nUser: " + source[start: start + rng.randrange(200, 800)])[-max_chars:]
            sessions[i] = (salt, text)
            batch.append(Prompt(text + "\nAssistant:", salt))
        made += len(batch)
        fault = None
        if faults and rounds and rng.random() < fault_rate:  # not before the first saves
            if not cycle:  # every kind once per cycle, in a seeded order
                cycle = rng.sample(faults, len(faults))
            fault = cycle.pop()
        split = fault == "second_engine" and len(batch) > 1
        rounds.append(Round(fault, [batch[::2], batch[1::2]] if split else [batch]))
    return rounds


class Engine:
    """A torture_engine.py process; ``kill`` is SIGKILL, as a crash would be."""

    def __init__(self, spec: dict, work: Path, name: str) -> None:
        spec_file = work / f"{name}.json"
        spec_file.write_text(json.dumps(spec))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.log = open(work / f"{name}.log", "ab")  # noqa: SIM115  (open as long as the process runs)
        self.proc = subprocess.Popen([sys.executable, str(ENGINE), str(spec_file)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                     start_new_session=True)
        self.preemptions = 0
        self._expect("READY", timeout=600)

    def _expect(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"engine exited (status {self.proc.poll()}); see {self.log.name}")
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise TimeoutError(f"engine gave no {prefix} within {timeout:.0f} s")

    def send(self, batch: list[Prompt], max_tokens: int) -> None:
        self.command({"prompts": [{"text": p.text, "salt": p.salt} for p in batch], "max_tokens": max_tokens})

    def command(self, command: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> list[dict]:
        reply = json.loads(self._expect("RESULT ", timeout=600))
        self.preemptions = reply["preemptions"]
        return reply["results"]

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
                return
        self.log.close()


def run_rounds(engines: list[Engine], rounds: list[Round], max_tokens: int,
               before_round=None, progress=None) -> list[list[list[dict]]]:
    """Each round's batches: at once on separate engines where there are enough, else one after another."""
    outputs = []
    for number, rnd in enumerate(rounds):
        if before_round is not None:
            before_round(number, rnd)
        results: list[list[dict]] = []
        for start in range(0, len(rnd.batches), len(engines)):
            group = list(zip(engines, rnd.batches[start: start + len(engines)]))
            for engine, batch in group:
                engine.send(batch, max_tokens)
            results.extend(engine.receive() for engine, _ in group)
        outputs.append(results)
        if progress is not None:
            progress(number, outputs)
    return outputs


def engine_spec(model: str, store: str | None, prefix_caching: bool, shape: dict, seed: int) -> dict:
    return {"model": model, "store": store, "prefix_caching": prefix_caching, "seed": seed, **shape}


def show_progress(number: int, total: int, outputs: list, reference_out: list, faults: dict[str, int],
                  started: float) -> None:
    """A line a round on stderr: how far the run is, and how many outputs differ so far (a run cut short still
    says what it found)."""
    done = [(got, want) for r in range(number + 1) for b, batch in enumerate(outputs[r])
            for got, want in zip(batch, reference_out[r][b])]
    print(f"round {number + 1}/{total}: {len(done)} requests, {sum(got['restored'] > 0 for got, _ in done)} restored, "
          f"{sum(got['tokens'] != want['tokens'] for got, want in done)} differ, faults {faults}, "
          f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)


#: Two tokens whose log-probabilities differ by less than this (nats) are a near tie: bf16 arithmetic
#: that starts from another position (where vLLM's cache or kvtool's entries end) may pick either.
NEAR_TIE = 0.5


def tie_gap(got: dict, want: dict) -> tuple[int, float]:
    """Where two greedy outputs first differ, and how far apart the two chosen tokens were there:
    the larger of what the reference preferred its token by and what kvtool's run preferred its own
    by (infinite where one token was not among the other run's top candidates)."""
    common = min(len(got["tokens"]), len(want["tokens"]))
    j = next((i for i in range(common) if got["tokens"][i] != want["tokens"][i]), common)
    if j >= min(len(got["logprobs"]), len(want["logprobs"])):
        return j, float("inf")
    mine, ref = got["logprobs"][j], want["logprobs"][j]
    g, w = str(got["tokens"][j]), str(want["tokens"][j])
    return j, max(ref[w] - ref.get(g, float("-inf")), mine[g] - mine.get(w, float("-inf")))


def compare(rounds: list[Round], kvtool_out, reference_out) -> tuple[int, int, list[dict]]:
    """(wrong, vllm_own, the differences): see the module's docstring for what tells them apart."""
    wrong = own = 0
    differences = []
    for number, rnd in enumerate(rounds):
        for b, batch in enumerate(rnd.batches):
            for i, _prompt in enumerate(batch):
                got, want = kvtool_out[number][b][i], reference_out[number][b][i]
                if got["tokens"] == want["tokens"]:
                    continue
                position, gap = tie_gap(got, want)
                tie = gap < NEAR_TIE
                own, wrong = own + tie, wrong + (not tie)
                differences.append({"round": number, "batch": b, "request": i, "restored": got["restored"],
                                    "failed_entries": got["failed_entries"], "kvtool": got["tokens"],
                                    "reference": want["tokens"], "first_difference": position,
                                    "gap_nats": round(gap, 4), "vllm_own": tie})
    return wrong, own, differences


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    block_size = rng.choice(args.block_sizes)
    chunk_tokens = block_size * rng.choice([1, 2, 3])
    shape = {"block_size": block_size, "chunk_tokens": chunk_tokens,
             "num_blocks": -(-2048 // block_size) + rng.randrange(2, 8)}
    faults = tuple(f for f in FAULTS if f in args.faults and (f not in SERVER_FAULTS or shutil.which("redis-server")))
    rounds = build_workload(rng, args.requests, args.concurrency, args.fault_rate, faults, args.max_prompt_chars)
    tally = Tally(requests=sum(len(b) for r in rounds for b in r.batches))
    work = Path(tempfile.mkdtemp(prefix="kvtool-torture-"))
    started = time.monotonic()
    redis = cluster = None
    try:
        reference = Engine(engine_spec(args.model, None, True, shape, args.seed), work, "reference")
        reference_out = run_rounds([reference], rounds, args.max_tokens)
        reference_preemptions = reference.preemptions
        reference.close()

        store_dir = work / "store"
        redis = Redis(work) if "redis_restart" in faults else None
        cluster = Cluster(work) if "cluster_master_kill" in faults else None
        capacity = args.file_capacity_mib << 20
        # The cluster takes what the file tier demotes; a lookup that misses both goes on to Redis.
        store_url = ",".join([f"file://{store_dir}?capacity={capacity}"] + [s.url for s in (cluster, redis) if s])
        spec = engine_spec(args.model, store_url, False, shape, args.seed)
        engines = [Engine(spec, work, "kvtool-0")]  # every engine, the second one too, opens this one store
        starts = [1]
        injector = Faults(rng, store_dir, capacity, redis, cluster, tally.faults)

        def swap_engine(kind: str) -> bool:
            if kind == "engine_kill":
                tally.preemptions += engines[0].preemptions
                engines[0].kill()
                engines[0] = Engine(spec, work, f"kvtool-{starts[0]}")
                starts[0] += 1
            elif kind == "second_engine" and len(engines) == 1:
                engines.append(Engine(spec, work, "kvtool-second"))
            return True

        def before_round(number: int, rnd: Round) -> None:
            injector.recover()
            if rnd.fault:
                injector.inject(rnd.fault, swap_engine)

        def progress(number: int, outputs: list) -> None:
            show_progress(number, len(rounds), outputs, reference_out, tally.faults, started)

        kvtool_out = run_rounds(engines, rounds, args.max_tokens, before_round, progress)
        for engine in engines:
            tally.preemptions += engine.preemptions
            engine.close()

        tally.wrong, tally.vllm_own, differences = compare(rounds, kvtool_out, reference_out)
        for batches in kvtool_out:
            for results in batches:
                for r in results:
                    tally.restored_requests += r["restored"] > 0
                    tally.restored_tokens += r["restored"]
                    tally.recomputed_after_fault += r["failed_entries"] > 0
        # What the second engine restored: the first engine's saves (the store is one), or its own.
        tally.second_engine_restored = sum(r["restored"] > 0 for number, rnd in enumerate(rounds)
                                           if len(rnd.batches) > 1 for r in kvtool_out[number][1])
    finally:
        for server in (redis, cluster):  # also when the run failed: no server outlives it
            if server:
                server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return {"seed": args.seed, **shape, "concurrency": args.concurrency, "rounds": len(rounds),
            "requests": tally.requests, "restored_requests": tally.restored_requests,
            "restored_tokens": tally.restored_tokens, "recomputed_after_fault": tally.recomputed_after_fault,
            "second_engine_restored": tally.second_engine_restored,
            "wrong": tally.wrong, "vllm_own": tally.vllm_own, "faults": tally.faults,
            "preemptions": tally.preemptions, "reference_preemptions": reference_preemptions,
            "differences": differences, "seconds": round(time.monotonic() - started, 1), **({"work": str(work)} if args.keep else {})}


def workload_arguments(parser: argparse.ArgumentParser, faults: tuple[str, ...], block_sizes: list[int]) -> None:
    """The options every torture over this workload takes (benchmarks/torture_lmcache.py too)."""
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000, help="workload seed (printed)")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--fault-rate", type=float, default=0.5, help="chance of a fault before each round")
    parser.add_argument("--faults", nargs="*", default=list(faults), choices=faults)
    parser.add_argument("--block-sizes", type=int, nargs="*", default=block_sizes)
    parser.add_argument("--max-prompt-chars", type=int, default=5000, help="a prompt's length at most")
    parser.add_argument("--file-capacity-mib", type=int, default=64, help="the file tier's capacity")
    parser.add_argument("--model", default=str(ROOT / "out" / "smollm2-135m"))
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, store)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")


def report(result: dict, as_json: bool) -> None:
    """The result as one JSON line, or a table."""
    if as_json:
        print(json.dumps(result))
    else:
        for name, value in result.items():
            print(f"{name:24} {value}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_arguments(parser, FAULTS, [16, 32, 64, 128])
    args = parser.parse_args(argv)
    print(f"torture: seed {args.seed}, {args.requests} requests", file=sys.stderr, flush=True)
    result = run(args)
    report(result, args.json)
    return 1 if result["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
