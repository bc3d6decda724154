"""Whether a recipe can keep a cache of a dtype, found by coding a small one and decoding it back."""

from __future__ import annotations

import numpy as np

from kvtool.cache import KVCache
from kvtool.dtypes import DTYPES
from kvtool.kvz import decode_cache, encode_cache
from kvtool.recipe import Recipe


def recipe_problem(recipe: str, dtype: str, heads: int = 2, dim: int = 32) -> str | None:
    """Why ``recipe`` cannot keep a KV cache of kvtool dtype ``dtype`` and ``heads`` x ``dim`` blocks (one line), or None.

    A recipe whose stages refuse the dtype (the lossy ones take bf16, fp16 and
    fp32), or a lossless one that does not give back the same bits, is named
    before the first prompt rather than at every save. The probe has the model's
    shape: a stage that codes with a model's dictionary (``pca``) takes that shape only.
    """
    values = np.random.default_rng(0).standard_normal((2, heads, 16, dim), dtype=np.float32)
    arrays = values.astype(DTYPES[dtype].numpy)  # [keys | values, heads, tokens, dim]
    sample = KVCache([arrays[0]], [arrays[1]])
    try:
        restored = decode_cache(encode_cache(sample, recipe, chunk_tokens=16))
    except Exception as exc:  # noqa: BLE001 - a probe: whatever stops it would stop every save
        return f"recipe {recipe!r} cannot keep a {dtype} KV cache: {exc}"
    if not Recipe.parse(recipe).lossy and not restored.equal_bits(sample):
        return f"recipe {recipe!r} does not give a {dtype} KV cache back bit for bit"
    return None
