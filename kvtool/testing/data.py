"""Test data shaped like real KV caches, for suites that must run without samples."""

from __future__ import annotations

import numpy as np
import ml_dtypes


def kv_like_bf16(heads: int = 3, tokens: int = 257, dim: int = 64, seed: int = 0) -> np.ndarray:
    """A bf16 ``[heads, tokens, dim]`` array with the per-channel scale spread of real keys.

    Real K/V channels differ in magnitude by orders of magnitude and a few
    channels carry outliers; this reproduces that exponent spread so codecs see
    realistic byte statistics. Prefer the real samples where they are available.
    """
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(0.0, 1.5, size=(heads, 1, dim)))
    values = rng.standard_normal((heads, tokens, dim)) * scale
    return values.astype(ml_dtypes.bfloat16)
