"""Learning a transform dictionary (``.kvd`` version 2) from real KV caches of a model.

Per layer and kind, every token vector of every cache (keys de-rotated first
where the model's rotary frequencies are given, at the token's position in its
sequence) adds to a mean and a covariance; the basis is the covariance's
eigenvectors by decreasing eigenvalue (principal component analysis), each
scaled to ``2**14`` and rounded to int16, its sign fixed so its largest entry is
positive. The coefficient tables are learnt from the training vectors'
coefficients: each class is the symbol distribution of standardized
coefficients scaled to one width of a geometric series, narrow to wide. Last,
each tensor's rate is measured on sample blocks of its training data at every
step of the calibration grid, with the tables and the class choice the stage
makes; the class model counts those choices.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from kvtool.cache import KVCache
from kvtool.errors import UsageError
from kvtool.modeldict.basis import (
    BASIS_BITS, MAX_CLASSES, PROB_BITS, PROB_SCALE, BasisDictionary, TensorBasis, coded_components,
)
from kvtool.modeldict.coefficients import MAX_Q, SYMBOLS, choose_classes, costs, symbols
from kvtool.modeldict.train import quantize

DEFAULT_CLASSES = 28
#: Class k (1..C) codes coefficients whose standard deviation is about ``2 ** ((k - 1 - WIDEST_BELOW) / 2)``.
WIDEST_BELOW = 6
#: The calibration grid: relative steps ``2 ** ((g - GRID_ZERO) / GRID_PER_OCTAVE)``.
GRID, GRID_ZERO, GRID_PER_OCTAVE = 48, 32, 8
#: Blocks per tensor that calibrate its rates, and standardized coefficients that shape the tables.
CALIBRATION_BLOCKS = 4
TABLE_SAMPLES = 1 << 20


def rope_frequencies(theta: float, dim: int) -> np.ndarray:
    """A rotary embedding's angle per position of each channel pair: ``theta ** (-2c / dim)`` (the models of
    Hugging Face transformers without rope scaling)."""
    if dim % 2 or not theta > 1:
        raise UsageError(f"rotary keys need an even head size and a theta above 1, not {dim} and {theta}")
    return (float(theta) ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)).astype(np.float32)


def token_vectors(tensor: np.ndarray, frequencies: np.ndarray | None, start: int) -> np.ndarray:
    """float64 ``[tokens, heads * dim]`` of a ``[heads, tokens, dim]`` tensor, de-rotated where ``frequencies`` are
    given (the sequence position of its first token is ``start``)."""
    heads, tokens, dim = tensor.shape
    x = np.asarray(tensor, np.float32).astype(np.float64).transpose(1, 0, 2)
    if frequencies is not None:
        angle = np.arange(start, start + tokens, dtype=np.float64)[:, None] * frequencies.astype(np.float64)
        cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
        a, b = x[..., : dim // 2], x[..., dim // 2 :]
        x = np.concatenate([a * cos + b * sin, b * cos - a * sin], axis=-1)
    return x.reshape(tokens, heads * dim)


class _Moments:
    """One tensor's running sums over its training vectors, and a few blocks of them kept for calibration."""

    def __init__(self, width: int):
        self.count, self.sum, self.outer, self.squares = 0, np.zeros(width), np.zeros((width, width)), 0.0
        self.blocks: list[np.ndarray] = []

    def add(self, vectors: np.ndarray, chunk_tokens: int) -> None:
        self.count += len(vectors)
        self.sum += vectors.sum(axis=0)
        self.outer += vectors.T @ vectors
        self.squares += float(np.square(vectors).sum())
        self.blocks += [vectors[t : t + chunk_tokens].copy() for t in range(0, len(vectors), chunk_tokens)]
        if len(self.blocks) > 4 * CALIBRATION_BLOCKS:  # memory stays bounded: every other block kept, spread over all
            self.blocks = self.blocks[::2]

    def basis(self, layer: int, kind: str, components: int) -> tuple[TensorBasis, np.ndarray]:
        """The tensor's basis of its first ``components`` components (rates still zero) and their float64
        eigenvectors, by row."""
        mean = self.sum / self.count
        covariance = self.outer / self.count - np.outer(mean, mean)
        variance, vectors = np.linalg.eigh((covariance + covariance.T) / 2)
        order = np.argsort(-variance, kind="stable")
        variance, vectors = np.maximum(variance[order], 0.0)[:components], vectors[:, order].T[:components]
        flip = vectors[np.arange(len(vectors)), np.abs(vectors).argmax(axis=1)] < 0
        vectors[flip] *= -1
        rows = np.clip(np.rint(vectors * (1 << BASIS_BITS)), -(1 << BASIS_BITS), 1 << BASIS_BITS).astype(np.int16)
        rms = float(np.sqrt(self.squares / (self.count * len(mean))))
        tensor = TensorBasis(layer, kind, float(np.float32(max(rms, 1e-30))), mean.astype(np.float32),
                             np.minimum.accumulate(variance.astype(np.float32)), np.zeros(GRID, np.float32), rows)
        return tensor, vectors


def train_basis(
    caches: Iterable[KVCache],
    rope_theta: float | None = None,
    classes: int = DEFAULT_CLASSES,
    chunk_tokens: int = 256,
    on_progress: Callable[[str], None] | None = None,
    components: int | None = None,
) -> BasisDictionary:
    """A transform dictionary learnt from ``caches`` (read one at a time); keys de-rotated with ``rope_theta``'s
    frequencies where it is given; each tensor's first ``components`` components kept (default: all; fewer make a
    smaller dictionary whose stage codes no more than they). Its metadata says what it was learnt from."""
    if not 1 <= classes <= MAX_CLASSES:
        raise UsageError(f"classes must be in 1..{MAX_CLASSES}, not {classes}")
    if components is not None and components < 1:
        raise UsageError(f"components must be at least 1, not {components}")
    moments: dict[tuple[int, str], _Moments] = {}
    sources, shape, frequencies = [], None, None
    facts: dict[str, Any] = {}
    for cache in caches:
        if not cache.num_layers or not cache.num_tokens:
            continue
        heads, _, dim = cache.keys[0].shape
        if shape not in (None, (heads, dim)):
            raise UsageError(f"caches of one model have one shape: {shape[0]} x {shape[1]} and {heads} x {dim} differ")
        if rope_theta is not None and cache.model.keys_post_rope is False:
            raise UsageError("--rope-theta de-rotates keys, but these caches hold keys before the rotary embedding")
        shape = (heads, dim)
        frequencies = rope_frequencies(rope_theta, dim) if rope_theta is not None else None
        facts = facts or {**cache.model.to_dict(), "num_kv_heads": heads, "head_dim": dim}
        sources.append({"text": str(cache.provenance.get("text_name", "unknown")), "tokens": cache.num_tokens})
        for layer, kind, tensor in cache.tensors():
            vectors = token_vectors(tensor, frequencies if kind == "k" else None, cache.token_start)
            moments.setdefault((layer, kind), _Moments(heads * dim)).add(vectors, chunk_tokens)
        if on_progress:
            on_progress(f"read {cache.num_layers} layers x {cache.num_tokens} tokens")
    if shape is None:
        raise UsageError("no KV data to train on")
    kept = min(components or shape[0] * shape[1], shape[0] * shape[1])
    bases = {key: m.basis(*key, kept) for key, m in sorted(moments.items(), key=lambda kv: (kv[0][0], kv[0][1]))}
    steps = (2.0 ** ((np.arange(GRID) - GRID_ZERO) / GRID_PER_OCTAVE)).astype(np.float32)
    samples = {key: _sample(m.blocks) for key, m in moments.items()}
    tables = _class_tables(bases, samples, classes)
    rates, chosen = _calibrate(bases, samples, steps, tables)
    class_model = quantize(chosen + 1.0, total=PROB_SCALE)
    meta = {"kind": "basis", "model": facts, "trained_on": sources, "chunk_tokens": chunk_tokens, "rope_theta": rope_theta,
            "classes": classes}
    tensors = tuple(TensorBasis(t.layer, t.kind, t.rms, t.mean, t.variance, rates[key], t.basis)
                    for key, (t, _) in bases.items())
    return BasisDictionary(shape[0], shape[1], frequencies if frequencies is not None else np.zeros(0, np.float32),
                           steps, class_model, tables, tensors, meta)


def _sample(blocks: list[np.ndarray]) -> list[np.ndarray]:
    """At most ``CALIBRATION_BLOCKS`` of a tensor's blocks, spread evenly over them."""
    if len(blocks) <= CALIBRATION_BLOCKS:
        return blocks
    return [blocks[i] for i in np.linspace(0, len(blocks) - 1, CALIBRATION_BLOCKS).astype(np.int64)]


def _coefficients(tensor: TensorBasis, vectors: np.ndarray, block: np.ndarray) -> np.ndarray:
    return (block - tensor.mean.astype(np.float64)) @ vectors.T


def _class_tables(bases, samples, classes: int) -> np.ndarray:
    """``[classes, SYMBOLS]`` frequencies: class k codes the standardized coefficients scaled to width ``w_k``."""
    pooled = []
    for key, (tensor, vectors) in bases.items():
        sigma = np.sqrt(tensor.variance.astype(np.float64))
        for block in samples[key]:
            y = _coefficients(tensor, vectors, block)
            pooled.append((y[:, sigma > 0] / sigma[sigma > 0]).reshape(-1))
    z = np.concatenate(pooled) if pooled else np.zeros(1)
    if len(z) > TABLE_SAMPLES:
        z = z[np.linspace(0, len(z) - 1, TABLE_SAMPLES).astype(np.int64)]
    tables = []
    for k in range(classes):
        width = 2.0 ** ((k - WIDEST_BELOW) / 2)
        q = np.clip(np.rint(z * width), -MAX_Q, MAX_Q).astype(np.int64)
        counts = np.bincount(symbols(q)[0], minlength=SYMBOLS).astype(np.float64)
        tables.append(quantize(counts + 0.25, total=PROB_SCALE))
    return np.stack(tables).astype(np.uint16)


def _calibrate(bases, samples, steps: np.ndarray, tables: np.ndarray) -> tuple[dict, np.ndarray]:
    """Each tensor's bits per value at every step (the class costs at a uniform class model), and how often
    each class was chosen over all of them."""
    table_costs = costs(tables, PROB_BITS)
    classes = len(tables)
    flat = np.full(classes + 1, int(costs(np.array([PROB_SCALE // (classes + 1)]), PROB_BITS)[0]))
    chosen = np.zeros(classes + 1)
    rates = {}
    for key, (tensor, vectors) in bases.items():
        deltas = steps.astype(np.float64) * tensor.rms
        kept = np.array([coded_components(tensor.variance, np.float32(d)) for d in deltas])
        bits, values = np.zeros(len(steps)), 0
        for block in samples[key]:
            y = _coefficients(tensor, vectors, block)  # [tokens, D]
            values += y.size
            q = np.clip(np.rint(y[None] / deltas[:, None, None]), -MAX_Q, MAX_Q).astype(np.int64)  # [G, tokens, D]
            q = np.where(np.arange(y.shape[1])[None, None, :] < kept[:, None, None], q, 0)  # none under the water
            sym, nbits, _ = symbols(q)
            flat_sym = sym.transpose(1, 0, 2).reshape(len(y), -1)  # [tokens, G * D]
            cls = choose_classes(flat_sym, table_costs, flat).reshape(len(steps), -1)
            live = np.arange(y.shape[1])[None, :] < kept[:, None]
            np.add.at(chosen, cls[live], 1)
            symbol_costs = np.where(cls[:, None, :] > 0, table_costs[np.maximum(cls - 1, 0)[:, None, :], sym], 0)
            bits += (symbol_costs.sum(axis=(1, 2)) + np.where(live, flat[cls], 0).sum(axis=1)) / 8 + nbits.sum(axis=(1, 2))
        rates[key] = (bits / max(values, 1)).astype(np.float32)
    return rates, chosen
