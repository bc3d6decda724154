"""Entropy limits of a KV cache, as the best ratio a coder of that kind can reach.

Each limit is the raw bits per value over the bits an entropy coder needs with
the statistics it names, plug-in estimates with the models free (what a coder
would spend on describing its tables is not counted). Order 0, no context:

``values``
    one table for whole values (16-bit patterns for bf16/fp16);
``byte_planes``
    one table per byte plane;
``sign_exp_per_channel``
    one table per channel for the (sign, exponent) fields, the mantissa raw;
``fields_per_channel``
    one table per channel for the (sign, exponent) fields and another for the mantissa;

and beyond order 0, with what ``ctxans`` codes as one symbol (sign, exponent
and the top mantissa bit; the other mantissa bits raw):

``sign_level_per_channel``
    one table per channel for that symbol;
``sign_level_context``
    one table per channel and context, the context being the one ``ctxans``
    uses: the channel's previous token's level relative to the channel's mean,
    in whole binades from -4 to +3, times its sign (16 contexts). Its side
    information, were it sent, is 16 tables per channel.

A channel is one ``(head, dim)`` position of one tensor, over all its tokens.
Limits are given for the whole cache and for its keys and values alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtool.modeldict import ctxans_reference
from kvtool.cache import KVCache
from kvtool.dtypes import DType, dtype_of
from kvtool.modeldict.train import CONTEXTS, default_context_map
from kvtool.stats import entropy_of_counts, per_channel_entropy, sign_exponent_entropy_per_channel

LIMITS = ("values", "byte_planes", "sign_exp_per_channel", "fields_per_channel", "sign_level_per_channel",
          "sign_level_context")
LABELS = {
    "values": "whole values",
    "byte_planes": "byte planes",
    "sign_exp_per_channel": "sign+exp per channel, mantissa raw",
    "fields_per_channel": "every field per channel",
    "sign_level_per_channel": "sign+exp+top mantissa bit per channel",
    "sign_level_context": "the same in ctxans's 16 contexts",
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
    level_bits: float = 0.0  # (sign, level) symbols per channel, order 0, plus the raw low mantissa bits
    context_bits: float = 0.0  # the same in ctxans's contexts

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
        order0, in_context = level_symbol_bits(array)
        raw = (d.mantissa_bits - 1) * array.size
        self.level_bits += order0 + raw
        self.context_bits += in_context + raw

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
            "sign_level_per_channel": raw / self.level_bits,
            "sign_level_context": raw / self.context_bits,
        }
        return {name: (round(v, 4) if v is not None and np.isfinite(v) else None) for name, v in out.items()}


def level_symbol_bits(array: np.ndarray) -> tuple[float, float]:
    """Bits the (sign, level) symbols of a ``[heads, tokens, dim]`` array need: order 0 per channel,
    and per channel in ctxans's contexts (plug-in entropies, summed over the values)."""
    family = ctxans_reference.FAMILIES[dtype_of(array).name]
    heads, tokens, dim = array.shape
    if not array.size:
        return 0.0, 0.0
    channels = heads * dim
    bits = np.ascontiguousarray(array).view(f"u{family.width}")
    sign, level, _ = (np.moveaxis(a, 0, 1).reshape(tokens, channels) for a in ctxans_reference.fields(bits, family))
    context_of, start = default_context_map()
    coded = ctxans_reference.symbols(sign, level, level.sum(axis=0) // tokens)
    context = np.empty_like(coded)
    context[1:] = context_of[coded[:-1]]
    context[0] = start
    alphabet = 2 * family.level_count
    symbol = sign * family.level_count + level
    bins = CONTEXTS * alphabet
    counts = np.bincount((np.arange(channels) * bins + context * alphabet + symbol).reshape(-1),
                         minlength=channels * bins).reshape(channels, CONTEXTS, alphabet)
    joint = float(entropy_of_counts(counts.reshape(channels, -1)).sum())
    contexts_only = float(entropy_of_counts(counts.sum(axis=2)).sum())
    order0 = float(entropy_of_counts(counts.sum(axis=1)).sum())
    return order0 * tokens, (joint - contexts_only) * tokens


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
    total.level_bits += part.level_bits
    total.context_bits += part.context_bits
