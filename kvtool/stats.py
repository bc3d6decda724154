"""Order-0 entropy statistics of KV tensors, in bits per symbol.

These bound what an entropy coder without context can reach: a byte plane of
entropy ``h`` bits compresses to no less than ``h / 8`` of its size that way.
Everything is a histogram (``np.bincount``), so it runs at memory speed.
"""

from __future__ import annotations

import numpy as np

from kvtool.dtypes import dtype_of


def entropy_of_counts(counts: np.ndarray) -> np.ndarray:
    """Entropy in bits of each histogram along the last axis (a scalar for one histogram)."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum(axis=-1, keepdims=True)
    p = counts / np.maximum(total, 1)
    logs = np.log2(p, out=np.zeros_like(p), where=p > 0)
    return -(p * logs).sum(axis=-1)


def byte_entropy(data: np.ndarray | bytes) -> float:
    """Order-0 entropy of a byte string or of an array's bytes, bits per byte."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(data, np.uint8)
    else:
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return float(entropy_of_counts(np.bincount(raw, minlength=256)))


def byte_plane_entropies(array: np.ndarray) -> list[float]:
    """The order-0 entropy of each byte plane of an array's elements, most significant byte first."""
    bits = np.ascontiguousarray(array).view(f"u{array.itemsize}")
    return [byte_entropy((bits >> (8 * i)).astype(np.uint8)) for i in reversed(range(array.itemsize))]


def sign_exponent(array: np.ndarray) -> np.ndarray:
    """Each float's sign and exponent fields as one integer ``sign << exponent_bits | exponent``."""
    dtype = dtype_of(array)
    return array.view(dtype.bits_view) >> dtype.mantissa_bits


def exponents(array: np.ndarray) -> np.ndarray:
    """Each float's biased exponent field."""
    dtype = dtype_of(array)
    return sign_exponent(array) & ((1 << dtype.exponent_bits) - 1)


def per_channel_entropy(symbols: np.ndarray, alphabet: int, token_axis: int = -2) -> np.ndarray:
    """Entropy in bits of each channel's symbols (integers below ``alphabet``) over the tokens.

    For a ``[heads, tokens, dim]`` block the result is ``[heads, dim]``: what a
    coder with one table per channel needs per value.
    """
    moved = np.moveaxis(symbols, token_axis, -1)
    channels = moved.shape[:-1]
    if moved.size == 0:
        return np.zeros(channels)
    codes = moved.reshape(-1, moved.shape[-1]).astype(np.intp)
    codes += (np.arange(codes.shape[0], dtype=np.intp) * alphabet)[:, None]
    counts = np.bincount(codes.reshape(-1), minlength=codes.shape[0] * alphabet)
    return entropy_of_counts(counts.reshape(-1, alphabet)).reshape(channels)


def sign_exponent_entropy_per_channel(array: np.ndarray, token_axis: int = -2) -> np.ndarray:
    """Entropy of the (sign, exponent) symbol over the tokens of each channel, bits per value."""
    return per_channel_entropy(sign_exponent(array), 1 << (1 + dtype_of(array).exponent_bits), token_axis)


def exponent_summary(array: np.ndarray, top: int = 3) -> dict:
    """Range and most common values of the unbiased exponents (``value ~ 2**e``) of nonzero normal values.

    Zeros and subnormals (exponent field 0) are left out; ``top`` lists the most
    common exponents with their share of those values.
    """
    dtype = dtype_of(array)
    bias = (1 << (dtype.exponent_bits - 1)) - 1
    counts = np.bincount(exponents(array).reshape(-1), minlength=1 << dtype.exponent_bits)[1:]
    total = int(counts.sum())
    if total == 0:
        return {"min": None, "max": None, "entropy_bits": 0.0, "top": []}
    present = np.flatnonzero(counts)
    common = np.argsort(counts, kind="stable")[::-1][:top]
    return {
        "min": int(present[0]) + 1 - bias,
        "max": int(present[-1]) + 1 - bias,
        "entropy_bits": round(float(entropy_of_counts(counts)), 4),
        "top": [{"exponent": int(i) + 1 - bias, "share": round(int(counts[i]) / total, 4)} for i in common if counts[i]],
    }
