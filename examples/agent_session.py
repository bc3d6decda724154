"""An agent session whose KV cache waits on disk while a tool runs, and comes back when it returns.

    python examples/agent_session.py
    python examples/agent_session.py --store 'memory://?capacity=64MiB,redis://127.0.0.1:6379/0'
    python examples/agent_session.py --serve                      # through the API, from another process
    python examples/agent_session.py --api http://127.0.0.1:8470  # through a running `kvtool serve`

The session's cache is a real one from samples/ (SmolLM2-135M, 256 tokens),
encoded chunk by chunk with ``kvtool.kvz.encode_cache``; where the
samples are missing, random bytes of the same size stand in. Each chunk of the
prompt is one store entry under a prefix key. While the agent waits for its
tool, the entries are unpinned and offloaded to the bottom tier; when the tool
returns they are prefetched back, and the longest cached prefix of the new,
longer prompt is restored instead of recomputed. Every move is printed from
the store's events.

With ``--api`` or ``--serve`` this process plays the orchestrator and the
store lives in a ``kvtool serve`` process (``--serve`` starts one on a private
unix socket with a throwaway token): the cache is stored and pinned over HTTP,
and when the tool is called the orchestrator sends one hint, "needed again in
2 s: offload now, prefetch 1.5 s ahead", so the cache is back in memory before
the agent resumes. Every move is printed from the server's event stream.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from kvtool.errors import KvtoolError
from kvtool.store import PrefixKeyer, StoreEvent, TieredStore, open_store

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "prose.safetensors"
RECIPE = "byteplane|zstd:1"
SAMPLE_TOKENS = 256
BYTES_PER_TOKEN = 23_040  # SmolLM2-135M in bf16: 30 layers x 2 x 3 heads x 64 dims x 2 bytes


def chunk_payloads(chunk_tokens: int) -> tuple[list[bytes], str]:
    """The encoded cache of each chunk of the prompt, and where it came from."""
    try:
        from kvtool.cache import KVCache
        from kvtool.kvz import encode_cache

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


def print_api_event(event: dict) -> None:
    data = event["data"]
    print_event(StoreEvent(event["event"], data["key"], data["tier"], data.get("reason", ""), data.get("from_tier")))


def main() -> None:
    """Run the session; a problem a user can cause (a bad URL, a server that does not answer) is one line."""
    try:
        session()
    except KvtoolError as exc:
        print(f"agent_session: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


def session() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="store URL(s), fastest first; default: 64 MiB of memory over a temporary file tier")
    parser.add_argument("--chunk-tokens", type=int, default=64, help="tokens per store entry (default: 64)")
    parser.add_argument("--api", help="drive a running kvtool API server at this URL (token: $KVTOOL_API_TOKEN or its file)")
    parser.add_argument("--serve", action="store_true", help="start `kvtool serve` over --store and drive it through the API")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvtool-agent-") as scratch:
        url = args.store or f"memory://?capacity=64MiB,file://{scratch}"
        if args.api or args.serve:
            from kvtool.server import ApiClient

            with (kvtool_serve(url, scratch) if args.serve else _nothing((args.api, None))) as (api_url, token):
                with ApiClient(api_url, token=token) as api:
                    run_session_over_api(api, args.chunk_tokens)
            return
        store = open_store(url)
        if not isinstance(store, TieredStore):
            store = TieredStore([store])
        with store:
            for tier in store.tiers:  # a tier that is down would turn the whole session into misses
                tier.check_reachable()
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
    if stored < len(keys):
        raise KvtoolError(f"stored {stored} of the prompt's {len(keys)} entries (the store logged why)")
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
    if not hit.values:
        raise KvtoolError("nothing of the prompt was restored (the store logged why)")
    print(f"  restored bytes identical to the stored ones: {hit.values == chunks[:len(hit.values)]}")

    stats = store.stats()
    print(f"\nevents: {stats['events']}")
    for tier in stats["tiers"]:
        print(f"  {tier['tier']:>8}: hits {tier['hits']}, misses {tier['misses']}, get p50 {tier['get_p50_ms'] or 0:.2f} ms")

    print("\n5. the session ends: its entries are evicted")
    for key in keys:
        store.evict(key)
    unsubscribe()


def run_session_over_api(api, chunk_tokens: int) -> None:
    """The same session, with the store in another process: what an agent framework would send."""
    prompt = list(range(1000, 1000 + SAMPLE_TOKENS))
    prefix = {"tokens": prompt, "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "recipe": RECIPE,
              "salt": "tenant-42", "chunk_tokens": chunk_tokens}
    keyer = PrefixKeyer(prefix["model"], RECIPE, salt=prefix["salt"], chunk_tokens=chunk_tokens)
    chunks, origin = chunk_payloads(chunk_tokens)
    tiers = [tier["tier"] for tier in api.stats()["tiers"]]
    print(f"API {api.url}; tiers: {', '.join(tiers)}; cache: {origin}, {sum(map(len, chunks)):,} bytes in {len(chunks)} entries")
    seen: list[str] = []

    def follow_events() -> None:
        for event in api.events():
            print_api_event(event)
            seen.append(event["event"])

    threading.Thread(target=follow_events, daemon=True).start()
    while api.stats()["api"]["event_streams"] == 0:
        time.sleep(0.01)

    print("\n1. the agent runs its prompt: the model server stores the cache; the orchestrator pins it")
    for key, chunk, tokens in zip(keyer.keys(prompt), chunks, keyer.chunk_lengths(len(prompt))):
        api.put(key, chunk, tokens=tokens)
    api.pin(prefix=prefix)

    print("\n2. the agent calls a tool that returns in 2 s: unpin, offload now, prefetch 1.5 s before it returns")
    api.unpin(prefix=prefix)
    api.hint(prefix=prefix, returns_in_s=2.0, offload=True, prefetch_ahead_s=1.5)
    print(f"  tiers now: {api.lookup(**prefix)['tokens_by_tier']}")
    time.sleep(2.0)  # the tool runs

    print("\n3. the tool returns: the cache is already back")
    tool_output = list(range(5000, 5000 + 40))
    found = api.lookup(**{**prefix, "tokens": prompt + tool_output})
    print(f"  stored {found['stored_tokens']} of {found['tokens']} tokens, by tier: {found['tokens_by_tier']}")

    print("\n4. the agent resumes: the shared prefix is restored")
    values = [api.get(key) for key in found["keys"]]
    print(f"  restored {found['stored_tokens']} of {found['tokens']} tokens from {len(values)} entries; "
          f"{found['tokens'] - found['stored_tokens']} tokens to recompute")
    if not values:
        raise KvtoolError("nothing of the prompt was restored (the server logged why)")
    print(f"  restored bytes identical to the stored ones: {values == chunks[:len(values)]}")
    stats = api.stats()
    print(f"\nevents: {stats['events']}")

    print("\n5. the session ends: its entries are evicted")
    evicted = api.evict(prefix=prefix)["ok"]
    deadline = time.monotonic() + 10
    while seen.count("evicted") < evicted and time.monotonic() < deadline:
        time.sleep(0.01)  # let the last events print


@contextmanager
def kvtool_serve(store_url: str, scratch: str) -> Iterator[tuple[str, str]]:
    """``kvtool serve`` in a child process on a private unix socket, with a throwaway token: (URL, token)."""
    token = secrets.token_urlsafe(32)
    env = {**os.environ, "KVTOOL_API_TOKEN": token}
    server = subprocess.Popen([sys.executable, "-m", "kvtool", "serve", "--store", store_url,
                               "--listen", f"unix://{scratch}/api.sock"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        banner = server.stderr.readline()
        match = re.search(r"kvtool API on (\S+) over", banner)
        if match is None:
            raise SystemExit(f"kvtool serve did not start: {banner}{server.stderr.read()}")
        yield match[1], token
    finally:
        server.terminate()
        server.wait(timeout=30)


@contextmanager
def _nothing(value: tuple[str, None]) -> Iterator[tuple[str, None]]:
    yield value


if __name__ == "__main__":
    main()
