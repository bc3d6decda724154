"""Order-0 entropy limits of a KV cache, as the best ratio a coder of that kind can reach.

Each limit is the raw bits per value over the bits an order-0 entropy coder
needs with the statistics it names (no context beyond that, models free):

``values``
    one table for whole values (16-bit patterns for bf16/fp16);
``byte_planes``
    one table per byte plane;
``sign_exp_per_channel``
    one table per channel for the (sign, exponent) fields, the mantissa raw;
``fields_per_channel``
    one table per channel for the (sign, exponent) fields and another for the mantissa.

A channel is one ``(head, dim)`` position of one tensor, over all its tokens.
Limits are given for the whole cache and for its keys and values alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtool.cache import KVCache
from kvtool.dtypes import DType
from kvtool.stats import entropy_of_counts, per_channel_entropy, sign_exponent_entropy_per_channel

LIMITS = ("values", "byte_planes", "sign_exp_per_channel", "fields_per_channel")
LABELS = {
    "values": "whole values",
    "byte_planes": "byte planes",
    "sign_exp_per_channel": "sign+exp per channel, mantissa raw",
    "fields_per_channel": "every field per channel",
}


@dataclass
class _Bits:
    """Histograms and per-channel bit totals of some tensors of one dtype."""

    dtype: DType
    values: int = 0
    value_counts: np.ndarray | None = None
    byte_counts: np.ndarray | None = None
    sign_exp_bits: float = 0.0
    mantissa_bits: float = 0.0

    def add(self, array: np.ndarray) -> None:
        d = self.dtype
        bits = np.ascontiguousarray(array).view(d.bits_view)
        flat = bits.reshape(-1)
        self.values += flat.size
        if 8 * d.itemsize <= 16:
            counts = np.bincount(flat, minlength=1 << (8 * d.itemsize))
            self.value_counts = counts if self.value_counts is None else self.value_counts + counts
        byte_counts = np.stack([np.bincount(((flat >> (8 * i)) & 0xFF).astype(np.uint8), minlength=256)
                                for i in range(d.itemsize)])
        self.byte_counts = byte_counts if self.byte_counts is None else self.byte_counts + byte_counts
        tokens = array.shape[-2]
        self.sign_exp_bits += float(sign_exponent_entropy_per_channel(array).sum()) * tokens
        if d.mantissa_bits <= 16:
            mantissa = (bits & ((1 << d.mantissa_bits) - 1)).astype(np.int64)
            self.mantissa_bits += float(per_channel_entropy(mantissa, 1 << d.mantissa_bits).sum()) * tokens

    def limits(self) -> dict[str, float | None]:
        if not self.values:
            return {name: None for name in LIMITS}
        raw = 8 * self.dtype.itemsize * self.values
        mantissa_raw = self.dtype.mantissa_bits * self.values
        value_counts, byte_counts = self.value_counts, self.byte_counts
        assert byte_counts is not None  # set by the first add()
        out = {
            "values": raw / (float(entropy_of_counts(value_counts)) * self.values)
            if value_counts is not None else None,
            "byte_planes": raw / (float(entropy_of_counts(byte_counts).sum()) * self.values),
            "sign_exp_per_channel": raw / (self.sign_exp_bits + mantissa_raw),
            "fields_per_channel": raw / (self.sign_exp_bits + self.mantissa_bits)
            if self.dtype.mantissa_bits <= 16 else None,
        }
        return {name: (round(v, 4) if v is not None and np.isfinite(v) else None) for name, v in out.items()}


def entropy_limits(cache: KVCache) -> dict[str, dict[str, float | None]]:
    """``{"all" | "k" | "v": {limit name: best ratio}}`` for ``cache``."""
    parts = {kind: _Bits(cache.dtype) for kind in ("all", "k", "v")}
    for _, kind, array in cache.tensors():
        parts[kind].add(array)
    for kind in ("k", "v"):
        _merge_into(parts["all"], parts[kind])
    return {kind: bits.limits() for kind, bits in parts.items()}


def _merge_into(total: _Bits, part: _Bits) -> None:
    total.values += part.values
    for name in ("value_counts", "byte_counts"):
        mine, theirs = getattr(total, name), getattr(part, name)
        if theirs is not None:
            setattr(total, name, theirs.copy() if mine is None else mine + theirs)
    total.sign_exp_bits += part.sign_exp_bits
    total.mantissa_bits += part.mantissa_bits
