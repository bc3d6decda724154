"""Learning a model dictionary from real KV caches of a model.

Every tensor of every cache is cut into blocks of ``chunk_tokens`` tokens, as
the container cuts them; each channel of each block becomes one sample: the
counts of its symbols in each context, as the ctxans coder sees them. The
samples are clustered into ``classes`` groups by the cost of coding them (a
Lloyd iteration: each sample joins the class that codes it in the fewest bits,
counting the class's own cost in the chunk, then each class becomes the
distribution of its samples), which is exactly the choice the encoder makes.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from kvtool.cache import KVCache
from kvtool.errors import UsageError
from kvtool.modeldict import ctxans_reference as ref
from kvtool.modeldict.format import (
    LEVELS, LOW, MAX_CLASSES, PROB_SCALE, REF_SYMBOLS, SYMBOLS, Dictionary,
)
from kvtool.repeats import repeated_rows

DEFAULT_CLASSES = 32
#: Contexts: the previous token's level relative to the reference, in whole binades from
#: -4 (and below, and escapes) to +3 (and above), times its sign.
CONTEXTS = 16
BINADES = (-4, 3)
#: At most this many (block, channel) samples take part; more are thinned evenly.
MAX_SAMPLES = 1 << 16
ITERATIONS = 16


def default_context_map() -> tuple[np.ndarray, int]:
    """``context_of`` for every symbol, and the context of a channel's first token."""
    sym = np.arange(SYMBOLS)
    q = sym % LEVELS
    binade = np.where(q > 0, np.floor_divide(LOW + q - 1, 2), BINADES[0])
    bucket = np.clip(binade, *BINADES) - BINADES[0]
    context_of = (bucket * 2 + sym // LEVELS).astype(np.uint8)
    return context_of, int(-BINADES[0] * 2)


def block_samples(block: np.ndarray, dtype_name: str, context_of: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray]:
    """Per channel of one block, its counts over (context, symbol), ``[channels, CONTEXTS * 64]``,
    and its reference's offset from the block's smallest reference."""
    family = ref.FAMILIES[dtype_name]
    heads, tokens, dim = block.shape
    channels = heads * dim
    bits = np.ascontiguousarray(block).view(f"u{family.width}")
    sign, level, _ = (np.moveaxis(a, 0, 1).reshape(tokens, channels) for a in ref.fields(bits, family))
    refs = level.sum(axis=0) // tokens
    sym = ref.symbols(sign, level, refs)
    prev = np.empty_like(sym)
    prev[1:] = context_of[sym[:-1]]
    prev[0] = start
    coded = np.repeat(repeated_rows(bits) == 0, dim, axis=1)
    bins = CONTEXTS * SYMBOLS
    pairs = (np.arange(channels) * bins + prev * SYMBOLS + sym)[coded]
    counts = np.bincount(pairs, minlength=channels * bins).reshape(channels, bins)
    return counts.astype(np.float32), refs - refs.min()


def quantize(weights: np.ndarray, floor: int = 1, total: int = PROB_SCALE) -> np.ndarray:
    """Integer frequencies summing to ``total``, each >= ``floor`` where its weight is > 0
    (or everywhere when ``floor`` is 1), nearest to ``weights`` by largest remainders."""
    weights = np.asarray(weights, np.float64)
    keep = np.ones(weights.shape, bool) if floor else weights > 0
    spare = total - int(keep.sum())
    share = np.where(keep, weights, 0) / weights[keep].sum() * spare
    freq = np.floor(share).astype(np.int64)
    short = spare - int(freq.sum())
    order = np.argsort(-(share - freq), kind="stable")
    freq[order[:short]] += 1
    quantized: np.ndarray = (freq + keep).astype(np.uint16)
    return quantized


def train(
    caches: Iterable[KVCache],
    classes: int = DEFAULT_CLASSES,
    chunk_tokens: int = 256,
    on_progress: Callable[[str], None] | None = None,
) -> Dictionary:
    """A dictionary learnt from ``caches`` (read one at a time).

    Its metadata says what it was learnt from (model, texts, tokens) and how
    many bits per value its classes needed there, symbols and class choices
    (the raw mantissa bits and a chunk's references not counted).
    """
    if not 1 <= classes <= MAX_CLASSES:
        raise UsageError(f"classes must be in 1..{MAX_CLASSES}, not {classes}")
    if chunk_tokens < 1:
        raise UsageError(f"chunk tokens must be >= 1, not {chunk_tokens}")
    context_of, start = default_context_map()
    samples, offsets, sources, models, dtypes = [], np.zeros(REF_SYMBOLS), [], set(), set()
    for cache in caches:
        models.add(cache.model.model_id)
        dtypes.add(cache.dtype.name)
        sources.append({"text": str(cache.provenance.get("text_name", "unknown")), "tokens": cache.num_tokens,
                        "layers": cache.num_layers})
        name = cache.dtype.name
        if name not in ref.FAMILIES:
            raise UsageError(f"cannot train on {name} caches")
        for layer, kind, tensor in cache.tensors():
            for t0 in range(0, tensor.shape[1], chunk_tokens):
                block = tensor[:, t0 : t0 + chunk_tokens]
                if not block.size:
                    continue
                counts, offs = block_samples(block, name, context_of, start)
                samples.append(counts)
                offsets += np.bincount(np.minimum(offs, REF_SYMBOLS - 1), minlength=REF_SYMBOLS)
        if on_progress:
            on_progress(f"read {cache.num_layers} layers x {cache.num_tokens} tokens")
    if not samples:
        raise UsageError("no KV data to train on")
    data = np.concatenate(samples)
    if len(data) > MAX_SAMPLES:
        data = data[np.linspace(0, len(data) - 1, MAX_SAMPLES).astype(np.int64)]
    freq, class_freq, bits = _cluster(data, min(classes, len(data)), on_progress)
    class_table = np.zeros(SYMBOLS, np.uint16)
    class_table[: len(class_freq)] = class_freq
    meta = {
        "models": sorted(models), "dtypes": sorted(dtypes), "trained_on": sources, "chunk_tokens": chunk_tokens,
        "classes": len(class_freq), "contexts": CONTEXTS, "samples": len(data), "bits_per_value": round(bits, 4),
    }
    return Dictionary(freq, context_of, start, class_table, quantize(offsets + 0.5), meta)


def _cluster(data: np.ndarray, n: int, on_progress: Callable[[str], None] | None) -> tuple[np.ndarray, np.ndarray, float]:
    """``n`` classes of symbol models ``[n, CONTEXTS, 64]``, the class model, and the bits per value
    they need on ``data``, by Lloyd iterations on coding cost."""
    marginal = data.reshape(len(data), CONTEXTS, SYMBOLS).sum(axis=1)
    level = marginal.reshape(len(data), 2, LEVELS).sum(axis=1)
    mean_level = (level * np.arange(LEVELS)).sum(axis=1) / np.maximum(level.sum(axis=1), 1)
    negative = marginal[:, LEVELS:].sum(axis=1) / np.maximum(marginal.sum(axis=1), 1)
    order = np.lexsort((mean_level, np.round(negative * 3)))  # start from classes of like samples
    assign = np.empty(len(data), np.int64)
    assign[order] = np.arange(len(data)) * n // len(data)
    for iteration in range(ITERATIONS):
        freq, class_freq = _models(data, assign, n)
        new, bits = _assign(data, freq, class_freq)
        if on_progress:
            on_progress(f"iteration {iteration + 1}: {bits:.4f} bits per value")
        if np.array_equal(new, assign):
            break
        assign = new
    freq, class_freq = _models(data, assign, n)
    return freq, class_freq, _assign(data, freq, class_freq)[1]


def _assign(data: np.ndarray, freq: np.ndarray, class_freq: np.ndarray) -> tuple[np.ndarray, float]:
    """Each sample's cheapest class, and the bits per value of coding every sample with its cheapest."""
    n = len(freq)
    cost = -(data @ np.log2(freq.reshape(n, -1).astype(np.float64) / PROB_SCALE).T.astype(np.float32))
    cost -= np.log2(class_freq / PROB_SCALE)
    return np.argmin(cost, axis=1), float(cost.min(axis=1).sum() / data.sum())


def _models(data: np.ndarray, assign: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Each class's quantised symbol models (its samples' counts, smoothed towards the pooled
    distribution of its context) and the class model (how many samples chose each)."""
    counts = np.stack([data[assign == k].sum(axis=0, dtype=np.float64) for k in range(n)]).reshape(n, CONTEXTS, SYMBOLS)
    pooled = counts.sum(axis=0) + 1.0
    prior = pooled / pooled.sum(axis=1, keepdims=True)
    smoothed = counts + 4.0 * prior
    freq = np.stack([quantize(row) for row in smoothed.reshape(-1, SYMBOLS)]).reshape(n, CONTEXTS, SYMBOLS)
    used = np.bincount(assign, minlength=n) + 1.0
    return freq, quantize(used)
