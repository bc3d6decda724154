"""A cost model: when does restoring a KV cache beat recomputing it, and how many bytes must be kept.

Times for a prompt of ``n`` tokens whose first ``p`` tokens are stored::

    recompute(n)      = a + b*n + c*n^2                       (prefill from nothing)
    suffix(p, n)      = a + b*(n-p) + c*(n^2 - p^2)           (prefill of the new tokens)
    restore(p)        = entries*latency + stored/bandwidth    (the tier)
                        + raw/decode_rate                     (checksums, decompression, layout)
                        + raw/build_rate                      (engine cache: host-to-device copy on a GPU)
    ttft_restore(p,n) = restore(p) + suffix(p, n)

with ``raw = p * bytes_per_token`` and ``stored = raw / ratio``; ``decode_rate`` is
one core's, times the cores free for decoding (``Inputs.decode_cores``: an
integration decodes the chunks of a restore on that many threads). The stages are
added, not overlapped, as the measured engine runs them; a layer-by-layer
overlap would hide part of restore behind the suffix prefill, so on such an
engine the model is pessimistic for restore. The quadratic term is attention:
prefill cost grows faster than the context.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from kvtool.errors import UsageError
from kvtool.model_shape import ModelShape

@dataclass(frozen=True)
class Prefill:
    """Seconds to prefill ``n`` tokens from nothing: ``a + b*n + c*n^2``."""

    a: float
    b: float
    c: float = 0.0

    def recompute(self, n: float) -> float:
        return self.a + self.b * n + self.c * n * n

    def work(self, n: float) -> float:
        """What prefilling ``n`` tokens costs beyond the fixed per-request time (which a restore pays too)."""
        return self.b * n + self.c * n * n

    def suffix(self, cached: float, total: float) -> float:
        return self.a + self.b * (total - cached) + self.c * (total * total - cached * cached)

    @classmethod
    def from_tokens_per_second(cls, rate: float) -> "Prefill":
        return cls(0.0, 1.0 / rate, 0.0)

    @classmethod
    def fit(cls, observations: Iterable[tuple[float, float, float]]) -> "Prefill":
        """Least squares over ``(cached, total, seconds)``: prefills from nothing (cached 0) and of suffixes.

        Terms that come out negative are dropped and the rest refit.
        """
        obs = np.asarray(list(observations), dtype=float).reshape(-1, 3)
        if len(obs) == 0:
            raise UsageError("no prefill measurements to fit")
        p, n, t = obs[:, 0], obs[:, 1], obs[:, 2]
        columns = {"a": np.ones_like(n), "b": n - p, "c": n * n - p * p}
        terms = {1: ["b"], 2: ["a", "b"]}.get(len(obs), ["a", "b", "c"])
        while True:
            coef, *_ = np.linalg.lstsq(np.stack([columns[k] for k in terms], axis=1), t, rcond=None)
            fitted = dict(zip(terms, coef))
            negative = [k for k in terms if fitted[k] < 0 and len(terms) > 1]
            if not negative:
                return cls(**{k: float(fitted.get(k, 0.0)) for k in "abc"})
            terms = [k for k in terms if k != negative[0]]


@dataclass(frozen=True)
class Tier:
    name: str
    bandwidth: float  # stored bytes per second
    latency: float = 0.0  # seconds per entry


@dataclass(frozen=True)
class CodecCost:
    name: str
    ratio: float  # raw bytes / stored bytes
    decode_rate: float  # raw bytes per second


@dataclass(frozen=True)
class Inputs:
    model: ModelShape
    prefill: Prefill
    tiers: list[Tier]
    codecs: list[CodecCost]
    build_rate: float  # raw bytes per second into the engine's cache
    chunk_tokens: int = 256
    sources: dict[str, str] = field(default_factory=dict)  # where each input came from
    decode_cores: float = 1.0  # cores free for decoding: codec decode rates are one core's

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["model"]["bytes_per_token"] = self.model.bytes_per_token
        return data


def restore_seconds(inputs: Inputs, tier: Tier, codec: CodecCost, cached: int) -> float:
    raw = cached * inputs.model.bytes_per_token
    entries = math.ceil(cached / inputs.chunk_tokens)
    return (entries * tier.latency + raw / codec.ratio / tier.bandwidth + raw / (codec.decode_rate * inputs.decode_cores)
            + raw / inputs.build_rate)


def ttft_restore(inputs: Inputs, tier: Tier, codec: CodecCost, cached: int, total: int) -> float:
    return restore_seconds(inputs, tier, codec, cached) + inputs.prefill.suffix(cached, total)


#: How far ``break_even`` looks: beyond this many tokens a "never" is reported.
BREAK_EVEN_LIMIT = 1 << 20


def break_even(inputs: Inputs, tier: Tier, codec: CodecCost, limit: int = BREAK_EVEN_LIMIT) -> int | None:
    """The smallest context from which restoring it is faster than recomputing it, for every longer context.

    Both sides leave out the fixed per-request prefill time, paid either way.
    None when recomputing stays faster up to ``limit`` tokens.
    """
    grid = np.unique(np.geomspace(1, limit, 2000).astype(int))
    faster = [restore_seconds(inputs, tier, codec, int(n)) < inputs.prefill.work(int(n)) for n in grid]
    if not faster[-1]:
        return None
    last_slower = max((i for i, f in enumerate(faster) if not f), default=-1)
    low = int(grid[last_slower]) if last_slower >= 0 else 0
    high = int(grid[last_slower + 1])
    while high - low > 1:  # restore is linear in n and recompute convex, so the boundary is one crossing
        mid = (low + high) // 2
        if restore_seconds(inputs, tier, codec, mid) < inputs.prefill.work(mid):
            high = mid
        else:
            low = mid
    return high


#: What a codec's gain is measured against when no codec named ``none`` is given: the raw bytes read into
#: place with no decode step (LMCache's ``fs`` adapter, vLLM's ``fs`` tier).
RAW = CodecCost("raw", 1.0, math.inf)


def baseline_codec(codecs: Sequence[CodecCost]) -> CodecCost:
    """The uncompressed way to keep the same bytes: the codec named ``none`` if given, else ``RAW``."""
    return next((c for c in codecs if c.name == "none"), RAW)


def seconds_per_raw_byte(tier: Tier, codec: CodecCost, decode_cores: float) -> float:
    """Seconds a restore spends per byte of KV on this tier with this codec: the stored bytes read, then decoded.

    Entry latency and the engine's build are left out: the same for every codec on a tier."""
    return 1.0 / (codec.ratio * tier.bandwidth) + 1.0 / (codec.decode_rate * decode_cores)


def pays(tier: Tier, codec: CodecCost, baseline: CodecCost, decode_cores: float) -> dict[str, Any]:
    """Whether ``codec`` restores faster than ``baseline`` from ``tier``, and the tier bandwidth below which it does.

    Per byte of KV, the codec saves ``1/bandwidth * (1/baseline.ratio - 1/ratio)`` of reading
    and costs ``(1/decode_rate - 1/baseline.decode_rate) / decode_cores`` more decoding, so it
    pays on tiers slower than the bandwidth where the two are equal: ``pays_below`` (bytes
    per second; None when it pays on any tier, as it decodes no slower; 0 when it pays on none).
    """
    mine, theirs = seconds_per_raw_byte(tier, codec, decode_cores), seconds_per_raw_byte(tier, baseline, decode_cores)
    saved_per_unit_bandwidth = 1.0 / baseline.ratio - 1.0 / codec.ratio
    extra_decode = (1.0 / codec.decode_rate - 1.0 / baseline.decode_rate) / decode_cores
    below: float | None
    if extra_decode <= 0:
        below = None if saved_per_unit_bandwidth > 0 or (saved_per_unit_bandwidth == 0 and extra_decode < 0) else 0.0
    else:
        below = max(0.0, saved_per_unit_bandwidth / extra_decode)
    return {"tier": tier.name, "bandwidth": tier.bandwidth, "codec": codec.name, "baseline": baseline.name,
            "decode_cores": decode_cores, "seconds_per_gb": mine * 1e9, "baseline_seconds_per_gb": theirs * 1e9,
            "saving": 1.0 - mine / theirs, "pays": mine < theirs, "pays_below": below}


def pays_table(inputs: Inputs) -> list[dict[str, Any]]:
    """``pays`` for every tier and every codec but the baseline."""
    baseline = baseline_codec(inputs.codecs)
    return [pays(t, c, baseline, inputs.decode_cores) for t in inputs.tiers for c in inputs.codecs if c is not baseline]


def capacity(inputs: Inputs, codec: CodecCost, context: int, concurrency: int, retained: int) -> dict[str, int]:
    """Bytes for ``concurrency`` running sessions (raw, in the engine: windowed layers hold only their window)
    and ``retained`` idle ones (stored: every token of every KV layer)."""
    per_session = context * inputs.model.bytes_per_token
    return {
        "bytes_per_session_raw": per_session,
        "engine_bytes": concurrency * inputs.model.engine_bytes(context),
        "store_bytes": math.ceil(retained * per_session / codec.ratio),
    }


def predict(inputs: Inputs, contexts: Sequence[int], hit_rate: float) -> list[dict[str, Any]]:
    """Per context, tier and codec: recompute vs restore TTFT with ``hit_rate`` of the prompt stored."""
    rows = []
    for n in contexts:
        cached = int(n * hit_rate)
        base = inputs.prefill.recompute(n)
        for tier in inputs.tiers:
            for codec in inputs.codecs:
                t = ttft_restore(inputs, tier, codec, cached, n)
                rows.append({
                    "context": n, "cached": cached, "tier": tier.name, "codec": codec.name,
                    "recompute_s": base, "restore_s": restore_seconds(inputs, tier, codec, cached),
                    "ttft_restore_s": t, "speedup": base / t,
                })
    return rows


def break_even_table(inputs: Inputs) -> list[dict[str, Any]]:
    return [
        {"tier": t.name, "codec": c.name, "break_even_tokens": break_even(inputs, t, c)}
        for t in inputs.tiers for c in inputs.codecs
    ]


# -- inputs from files ------------------------------------------------------------------------


def shape_from_gguf(path: str | Path, dtype: str = "bf16") -> ModelShape:
    """The same facts from a GGUF file's metadata (the ``gguf`` package's reader)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise UsageError("reading a GGUF file needs the gguf package: pip install 'kvtool[model]'") from None
    reader = GGUFReader(str(path))

    def value(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = value("general.architecture")
    heads = value(f"{arch}.attention.head_count")
    head_dim = value(f"{arch}.attention.key_length") or value(f"{arch}.embedding_length") // heads
    return ModelShape(
        name=value("general.name") or Path(path).stem,
        layers=value(f"{arch}.block_count"),
        kv_heads=value(f"{arch}.attention.head_count_kv") or heads,
        head_dim=head_dim,
        dtype=dtype,
    )


def codecs_from_bench(path: str | Path, threads: str = "1") -> list[CodecCost]:
    """Ratio and decode rate per recipe from ``kvtool bench --json`` (averaged over its files)."""
    report = json.loads(Path(path).read_text())
    found: dict[str, list[tuple[float, float]]] = {}
    for file in report.get("files", []):
        for r in file.get("results", []):
            rate = (r.get("decompress_mbps") or {}).get(threads)
            if r.get("status") == "ok" and r.get("ratio") and rate:
                found.setdefault(r["recipe"], []).append((r["ratio"], rate * 1e6))
    if not found:
        raise UsageError(f"{path}: no measured recipes (is it `kvtool bench --json` output?)")
    return [CodecCost(name, float(np.mean([x for x, _ in v])), float(np.mean([y for _, y in v]))) for name, v in found.items()]


def best_of_repeats(ttft_result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per configuration, the fastest repeat of each turn.

    On a shared machine other work only ever adds time, so the fastest of
    several repeats is the closest to the cost of the work itself.
    """
    best: dict[str, dict[int, dict[str, Any]]] = {}
    for name, rows in ttft_result["turns"].items():
        for r in rows:
            kept = best.setdefault(name, {}).get(r["turn"])
            if kept is None or r["ttft_s"] < kept["ttft_s"]:
                best[name][r["turn"]] = r
    return {name: [by_turn[t] for t in sorted(by_turn)] for name, by_turn in best.items()}


def calibrate(ttft_result: dict[str, Any], model: ModelShape) -> Inputs:
    """Inputs measured in one ``kvtool bench ttft --json`` run (HF engine): prefill fit, tiers, codecs, build rate.

    The prefill model is fitted to every prefill of the run: the recomputes and
    the suffixes after a restore. Each turn counts with its fastest repeat.
    """
    turns = best_of_repeats(ttft_result)
    observations = [(0, r["tokens"], r["ttft_s"]) for r in turns["recompute"]]
    observations += [
        (r["restored_tokens"], r["tokens"], r["prefill_s"]) for rows in turns.values() for r in rows if "prefill_s" in r
    ]
    prefill = Prefill.fit(observations)
    tiers: dict[str, list[tuple[float, float]]] = {}
    codecs: dict[str, list[tuple[float, float, float]]] = {}
    build: list[tuple[float, float]] = []
    for name, rows in turns.items():
        if name == "recompute" or "fetch_s" not in rows[0]:
            continue
        tier, _, recipe = name.partition("/")
        stored = sum(r["stored_bytes"] for r in rows)
        raw = sum(r["raw_bytes"] for r in rows)
        tiers.setdefault(tier, []).append((stored, sum(r["fetch_s"] for r in rows)))
        codecs.setdefault(recipe, []).append((raw, stored, sum(r["decode_s"] for r in rows)))
        build.append((raw, sum(r["build_s"] for r in rows)))
    return Inputs(
        model=model,
        prefill=prefill,
        tiers=[Tier(t, sum(b for b, _ in v) / sum(s for _, s in v)) for t, v in tiers.items()],
        codecs=[CodecCost(c, sum(r for r, _, _ in v) / sum(s for _, s, _ in v), sum(r for r, _, _ in v) / sum(d for _, _, d in v)) for c, v in codecs.items()],
        build_rate=sum(r for r, _ in build) / sum(s for _, s in build),
        chunk_tokens=ttft_result.get("chunk_tokens", 256),
        sources={what: "measured in the kvtool bench ttft run given" for what in ("prefill", "tiers", "codecs", "build_rate")},
    )


def validate(ttft_result: dict[str, Any], inputs: Inputs) -> list[dict[str, Any]]:
    """Predicted vs measured TTFT (fastest repeat) for every turn and configuration of a TTFT run."""
    turns = best_of_repeats(ttft_result)
    tiers = {t.name: t for t in inputs.tiers}
    codecs = {c.name: c for c in inputs.codecs}
    rows = []
    for name, measured in turns.items():
        for r in measured:
            if name == "recompute":
                predicted = inputs.prefill.recompute(r["tokens"])
            else:
                tier, _, recipe = name.partition("/")
                predicted = ttft_restore(inputs, tiers[tier], codecs[recipe], r["restored_tokens"], r["tokens"])
            rows.append({
                "config": name, "turn": r["turn"], "tokens": r["tokens"], "measured_s": r["ttft_s"],
                "predicted_s": predicted, "error": predicted / r["ttft_s"] - 1,
            })
    return rows
