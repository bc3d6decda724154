"""An agent session whose KV cache waits on disk while a tool runs, and comes back when it returns.

    python examples/agent_session.py
    python examples/agent_session.py --store 'memory://?capacity=64MiB,redis://127.0.0.1:6379/0'

The session's cache is a real one from samples/ (SmolLM2-135M, 256 tokens),
encoded chunk by chunk with ``kvtool.container.encode_cache``; where the
samples are missing, random bytes of the same size stand in. Each chunk of the
prompt is one store entry under a prefix key. While the agent waits for its
tool, the entries are unpinned and offloaded to the bottom tier; when the tool
returns they are prefetched back, and the longest cached prefix of the new,
longer prompt is restored instead of recomputed. Every move is printed from
the store's events.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from kvtool.store import PrefixKeyer, StoreEvent, TieredStore, open_store

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "prose.safetensors"
RECIPE = "byteplane|zstd:1"
SAMPLE_TOKENS = 256
BYTES_PER_TOKEN = 23_040  # SmolLM2-135M in bf16: 30 layers x 2 x 3 heads x 64 dims x 2 bytes


def chunk_payloads(chunk_tokens: int) -> tuple[list[bytes], str]:
    """The encoded cache of each chunk of the prompt, and where it came from."""
    try:
        from kvtool.cache import KVCache
        from kvtool.container import encode_cache

        cache = KVCache.load(SAMPLE)
    except (ImportError, OSError) as exc:
        rng = np.random.default_rng(0)
        sizes = [chunk_tokens * BYTES_PER_TOKEN] * (SAMPLE_TOKENS // chunk_tokens)
        return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes], f"random bytes ({exc})"
    blobs = []
    for start in range(0, cache.num_tokens, chunk_tokens):
        piece = cache.select(tokens=slice(start, start + chunk_tokens))
        blobs.append(encode_cache(piece, RECIPE))
    return blobs, f"{SAMPLE.name} encoded with {RECIPE!r}"


_print_lock = threading.Lock()  # events arrive from the prefetch threads too


def print_event(event: StoreEvent) -> None:
    where = f"{event.from_tier} -> {event.tier}" if event.from_tier else event.tier
    with _print_lock:
        print(f"  [{event.kind:>8}] {event.key[:12]}…  {where}  {event.reason}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="store URL(s), fastest first; default: 64 MiB of memory over a temporary file tier")
    parser.add_argument("--chunk-tokens", type=int, default=64, help="tokens per store entry (default: 64)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvtool-agent-") as scratch:
        url = args.store or f"memory://?capacity=64MiB,file://{scratch}"
        store = open_store(url)
        if not isinstance(store, TieredStore):
            store = TieredStore([store])
        with store:
            run_session(store, args.chunk_tokens)


def run_session(store: TieredStore, chunk_tokens: int) -> None:
    keyer = PrefixKeyer("HuggingFaceTB/SmolLM2-135M-Instruct", RECIPE, salt="tenant-42", chunk_tokens=chunk_tokens)
    prompt = list(range(1000, 1000 + SAMPLE_TOKENS))  # stands in for the tokenised conversation
    chunks, origin = chunk_payloads(chunk_tokens)
    print(f"tiers: {', '.join(store.tier_names)}; cache: {origin}, {sum(map(len, chunks)):,} bytes in {len(chunks)} entries")
    unsubscribe = store.subscribe(print_event)

    print("\n1. the agent runs its prompt: the cache is stored and pinned while the model uses it")
    keys = keyer.keys(prompt)
    stored = store.put_prefix(keyer, prompt, chunks)
    for key in keys[:stored]:
        store.pin(key)

    print("\n2. the agent calls a tool: its cache is unpinned and offloaded to the bottom tier")
    for key in keys[:stored]:
        store.unpin(key)
        store.offload(key, to=-1)
    print(f"  tiers now: {[store.tier_of(k) for k in keys]}")
    time.sleep(0.2)  # the tool runs

    print("\n3. the tool is about to return: the cache is prefetched in the background")
    futures = store.prefetch(keys)
    at_top = [f.result() for f in futures]
    print(f"  prefetched to {store.tier_names[0]}: {sum(at_top)}/{len(at_top)} entries")

    print("\n4. the agent resumes with the tool's output appended: the shared prefix is restored")
    tool_output = list(range(5000, 5000 + 40))
    hit = store.get_prefix(keyer, prompt + tool_output)
    print(f"  restored {hit.tokens} of {len(prompt) + len(tool_output)} tokens from {len(hit.values)} entries; "
          f"{len(prompt) + len(tool_output) - hit.tokens} tokens to recompute")
    print(f"  restored bytes identical to the stored ones: {hit.values == chunks[:len(hit.values)]}")

    stats = store.stats()
    print(f"\nevents: {stats['events']}")
    for tier in stats["tiers"]:
        print(f"  {tier['tier']:>8}: hits {tier['hits']}, misses {tier['misses']}, get p50 {tier['get_p50_ms'] or 0:.2f} ms")

    print("\n5. the session ends: its entries are evicted")
    for key in keys:
        store.evict(key)
    unsubscribe()


if __name__ == "__main__":
    main()
