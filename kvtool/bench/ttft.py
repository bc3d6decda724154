"""Restore beats recompute: time to first token over a multi-turn agent trace.

Every turn starts with no engine-side cache (the pause between turns is long
enough for the engine to have evicted it). Without offload the engine
recomputes the whole prompt; with offload it restores the stored prefix from
a kvtool tier and prefills only the new tokens. One configuration is a tier
(memory, file, redis) and a recipe (``none``: stored uncompressed; the default
recipe; QAT's gzip). The recompute baseline of a turn is the same for every
configuration, so it runs once per repeat and its cache is what each
configuration stores before the turn (the cache a server saves at the end of
the previous turn; storing is not timed).

Restore time is split into fetch (reading the prefix's entries from the
tier, zero-copy where the tier allows), decode (checksums, decompression,
inverse layout), and build (the engine's cache object); TTFT adds the
prefill of the new tokens and the first token.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from kvtool.bench.trace import Turn
from kvtool.cache import KVCache
from kvtool.kvz import decode_cache, encode_cache
from kvtool.recipe import DEFAULT_RECIPE
from kvtool.store import PrefixKeyer, open_store
from kvtool.store.base import Store

RECIPES = {"none": "none", "default": DEFAULT_RECIPE, "qat": "byteplane|qat:1"}
TIERS = ("memory", "file", "redis")
RECOMPUTE = "recompute"


@dataclass(frozen=True)
class Config:
    tier: str
    recipe_name: str

    @property
    def name(self) -> str:
        return f"{self.tier}/{self.recipe_name}"

    @property
    def recipe(self) -> str:
        return RECIPES[self.recipe_name]


def configs(tiers: Sequence[str], recipes: Sequence[str]) -> list[Config]:
    return [Config(t, r) for t in tiers for r in recipes]


def store_url(tier: str, workdir: Path, redis_url: str | None) -> str:
    if tier == "memory":
        return "memory://?capacity=4GiB"
    if tier == "file":
        return f"file://{workdir / 'file-tier'}"
    return redis_url or ""


def chunks_of(cache: KVCache, chunk_tokens: int, recipe: str) -> list[bytes]:
    return [
        encode_cache(cache.select(tokens=slice(start, start + chunk_tokens)), recipe)
        for start in range(0, cache.num_tokens, chunk_tokens)
    ]


def restore_prefix(store: Store, keyer: PrefixKeyer, tokens: Sequence[int]) -> tuple[KVCache | None, dict[str, float]]:
    """The longest stored prefix of ``tokens`` as one cache, and the time and bytes it took."""
    start = time.perf_counter()
    values = []
    for key in keyer.keys(tokens):
        entry = store.get_entry(key)
        if entry is None:
            break
        values.append(entry.value)
    fetched = time.perf_counter()
    parts = [decode_cache(v) for v in values]
    cache = None
    if parts:
        cache = KVCache(
            [np.concatenate([p.keys[i] for p in parts], axis=1) for i in range(parts[0].num_layers)],
            [np.concatenate([p.values[i] for p in parts], axis=1) for i in range(parts[0].num_layers)],
            parts[0].model,
        )
    decoded = time.perf_counter()
    timing = {
        "fetch_s": fetched - start,
        "decode_s": decoded - fetched,
        "stored_bytes": sum(len(v) for v in values),
        "entries": len(values),
    }
    return cache, timing


def restore_turn(engine, store: Store, keyer: PrefixKeyer, recipe: str, turn: Turn, prefix: KVCache, chunk_tokens: int) -> dict:
    """Store a turn's prefix (untimed, as the previous turn would have), then time restore and resume."""
    encode_start = time.perf_counter()
    chunks = chunks_of(prefix, chunk_tokens, recipe)
    encode_s = time.perf_counter() - encode_start
    store.put_prefix(keyer, turn.tokens[: turn.cached_tokens], chunks)
    start = time.perf_counter()
    restored, timing = restore_prefix(store, keyer, turn.tokens)
    if restored is None:
        raise RuntimeError(f"the stored prefix of turn {turn.index} was not found in {store.describe()}")
    build_s, prefill_s, first = engine.resume(restored, turn.tokens)
    row = {
        "turn": turn.index, "tokens": len(turn.tokens), "ttft_s": time.perf_counter() - start,
        "first_token": first, "restored_tokens": restored.num_tokens, **timing,
        "build_s": build_s, "prefill_s": prefill_s, "raw_bytes": restored.nbytes, "encode_s": encode_s,
    }
    for key in keyer.keys(turn.tokens[: turn.cached_tokens]):
        store.delete(key)  # each turn restores only what its previous turn stored
    return row


def run(
    engine,
    trace: Sequence[Turn],
    *,
    tiers: Sequence[str] = TIERS,
    recipes: Sequence[str] = tuple(RECIPES),
    redis_url: str | None = None,
    chunk_tokens: int = 128,
    repeats: int = 1,
    progress: Callable[[str], None] = lambda message: None,
) -> dict[str, Any]:
    """Run the experiment with an engine exposing ``recompute``, ``resume``, ``warm_up`` and ``model_id``.

    Turn by turn, the recompute and then every configuration, so that a slow
    stretch on a shared machine falls on all of them alike.
    """
    notes = []
    if "redis" in tiers and not redis_url:
        tiers = [t for t in tiers if t != "redis"]
        notes.append("redis: not measured (no --redis-url)")
    chosen = configs(tiers, recipes)
    results: dict[str, list[dict]] = {RECOMPUTE: [], **{c.name: [] for c in chosen}}
    with tempfile.TemporaryDirectory(prefix="kvtool-ttft-") as workdir, contextlib.ExitStack() as stack:
        stores = {c.name: stack.enter_context(open_store(store_url(c.tier, Path(workdir) / c.recipe_name, redis_url))) for c in chosen}
        keyers = {c.name: PrefixKeyer(engine.model_id, c.recipe, chunk_tokens=chunk_tokens) for c in chosen}
        engine.warm_up()
        for repeat in range(repeats):
            for turn in trace:
                progress(f"turn {turn.index} ({len(turn.tokens)} tokens): recompute")
                seconds, first, cache = engine.recompute(turn.tokens)
                results[RECOMPUTE].append({
                    "turn": turn.index, "tokens": len(turn.tokens), "ttft_s": seconds, "first_token": first,
                    "restored_tokens": 0, "repeat": repeat,
                })
                prefix = cache.select(tokens=slice(0, turn.cached_tokens))
                for c in chosen:
                    progress(f"turn {turn.index}: {c.name}")
                    row = restore_turn(engine, stores[c.name], keyers[c.name], c.recipe, turn, prefix, chunk_tokens)
                    results[c.name].append({**row, "repeat": repeat})
    return summarise(engine.name, engine.model_id, trace, results, notes, chunk_tokens)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q))


def summarise(engine: str, model_id: str, trace: Sequence[Turn], results: dict[str, list[dict]], notes: list[str], chunk_tokens: int) -> dict[str, Any]:
    """Per configuration: TTFT p50/p90, speedup over recompute, overhead over the same tier uncompressed."""
    base_p50 = percentile([r["ttft_s"] for r in results[RECOMPUTE]], 50)
    summary = []
    for name, rows in results.items():
        ttfts = [r["ttft_s"] for r in rows]
        tier, _, recipe = name.partition("/")
        row: dict[str, Any] = {
            "config": name, "tier": tier if recipe else None, "recipe": RECIPES.get(recipe) if recipe else None,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
        }
        row["speedup"] = base_p50 / row["ttft_p50_s"]
        if recipe and "fetch_s" in rows[0]:  # the vLLM engine times whole requests only
            restore = [r["fetch_s"] + r["decode_s"] + r["build_s"] for r in rows]
            row["restore_p50_s"] = percentile(restore, 50)
            row["ratio"] = sum(r["raw_bytes"] for r in rows) / sum(r["stored_bytes"] for r in rows)
        if recipe:
            row["first_token_matches"] = all(
                r["first_token"] == b["first_token"] for r, b in zip(rows, results[RECOMPUTE])
            )
        summary.append(row)
    for row in summary:
        if row["recipe"] and row["recipe"] != RECIPES["none"]:
            plain = next((s for s in summary if s["config"] == f"{row['tier']}/none"), None)
            if plain:
                row["overhead_vs_none"] = row["ttft_p50_s"] / plain["ttft_p50_s"] - 1
                if "restore_p50_s" in row:
                    row["restore_overhead_vs_none"] = row["restore_p50_s"] / plain["restore_p50_s"] - 1
    return {
        "engine": engine,
        "model": model_id,
        "chunk_tokens": chunk_tokens,
        "trace": [{"turn": t.index, "tokens": len(t.tokens), "cached_tokens": t.cached_tokens} for t in trace],
        "summary": summary,
        "turns": results,
        "not_measured": notes,
    }


def plot(result: dict[str, Any], path: str | Path) -> None:
    """TTFT per turn for each configuration (lines), p50 per configuration (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_turn, by_config) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, rows in result["turns"].items():
        by_tokens: dict[int, list[float]] = {}
        for r in rows:
            by_tokens.setdefault(r["tokens"], []).append(r["ttft_s"])
        style = {"color": "black", "linewidth": 2.5} if name == RECOMPUTE else {}
        tokens = sorted(by_tokens)
        by_turn.plot(tokens, [percentile(by_tokens[n], 50) for n in tokens], marker="o", label=name, **style)
    by_turn.set_xlabel("prompt tokens")
    by_turn.set_ylabel("TTFT (s)")
    by_turn.set_title(f"TTFT per turn, median of repeats ({result['engine']}, {result['model']})")
    by_turn.legend(fontsize=7)
    names = [s["config"] for s in result["summary"]]
    p50 = [s["ttft_p50_s"] for s in result["summary"]]
    p90 = [s["ttft_p90_s"] for s in result["summary"]]
    by_config.bar(names, p50, yerr=[[0] * len(p50), [b - a for a, b in zip(p50, p90)]], capsize=3)
    by_config.set_ylabel("TTFT p50 (s), whisker to p90")
    by_config.tick_params(axis="x", rotation=60, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
