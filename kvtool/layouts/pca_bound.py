"""The ``pca`` stage's error bound: how far each restored value may lie from the value written.

The conformance suite checks every restored value against it on real caches.
A coefficient comes back within half a step of its float32 projection; the
reconstruction adds what the coded components leave out of the value (the
projection residual, including the int16 basis' small departure from an
orthonormal one) and the rounding of each float32 operation on the way; the
rotation of keys mixes the two channels of a pair; last, the rounding into the
cache's dtype. Tokens kept exact come back exact. Computed in float64, with
each float32 operation's rounding bounded by ``2**-24`` of its operands'
magnitudes (and slack on top).
"""

from __future__ import annotations

import numpy as np

from kvtool.dtypes import dtype_of
from kvtool.layouts import pca_reference as ref
from kvtool.layouts.lossy import rounding_bound
from kvtool.modeldict.basis import BASIS_BITS

#: float32's unit roundoff, with room for a few operations in a row.
ROUND = 2.0**-21


def error_bound(block: np.ndarray, tensor: ref.Tensor, position: int, exact: np.ndarray) -> np.ndarray:
    """float64 ``[heads, n, dim]``: a bound on ``|restored - block|`` for every value."""
    heads, tokens, dim = block.shape
    y = ref.centered(block, tensor, position)
    acc = ref.coefficients(y, tensor)
    q = ref.quantize(acc, tensor)
    exact = exact | ref.exact_beyond(q, tensor, block.dtype)
    basis = tensor.basis.astype(np.float64) * 2.0**-BASIS_BITS  # [c, D]
    magnitude = np.abs(basis)
    y64 = y.astype(np.float64)
    step = float(tensor.step)
    terms = np.abs(y64) @ magnitude.T  # [tokens, c]: what each float32 sum adds up
    coefficient = step / 2 + np.abs(acc.astype(np.float64)) * 2.0**-50 + tensor.width * ROUND * terms
    residual = np.abs(y64 @ basis.T @ basis - y64)
    restored = np.abs(np.where(exact[:, None], 0.0, q)) * step @ magnitude  # [tokens, D]: magnitudes the decoder's sums reach
    mean = np.abs(tensor.mean.astype(np.float64))
    own = coefficient @ magnitude + residual + ROUND * (restored + mean + np.abs(y64) + 2 * np.abs(y64 + mean))
    own = own.reshape(tokens, heads, dim)
    if tensor.frequencies is not None:  # a pair's errors mix when it turns back, and each turn rounds
        half = dim // 2
        pair = own[..., :half] + own[..., half:]
        values = np.abs(block.astype(np.float64).transpose(1, 0, 2))
        turn = ROUND * 4 * (values[..., :half] + values[..., half:] + pair)
        own = np.concatenate([pair + turn, pair + turn], axis=-1)
    own[exact] = 0.0
    values = np.abs(block.astype(np.float64)).transpose(1, 0, 2)
    total = own + np.where(exact[:, None, None], 0.0, rounding_bound(values + own, dtype_of(block.dtype)))
    return np.ascontiguousarray(total.transpose(1, 0, 2))
