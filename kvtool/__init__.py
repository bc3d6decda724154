"""kvtool: keep LLM KV caches instead of recomputing them.

The library API (``load``, ``save``, ``iter_caches``, ``open_kvz``, ``KVCache``,
``Recipe``) is imported on first use, and no optional library (torch, redis,
vllm, QATzip) is imported until the component that needs it is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load": "kvtool.api",
    "save": "kvtool.api",
    "iter_caches": "kvtool.api",
    "open_kvz": "kvtool.kvz",
    "encode_cache": "kvtool.kvz",
    "decode_cache": "kvtool.kvz",
    "KVCache": "kvtool.cache",
    "ModelFacts": "kvtool.cache",
    "Recipe": "kvtool.recipe",
    "DEFAULT_RECIPE": "kvtool.recipe",
}

__all__ = ["__version__", *_LAZY]  # noqa: PLE0604 - the keys of _LAZY: names


def __getattr__(name: str) -> Any:  # the lazily imported names, as their modules type them
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvtool' has no attribute {name!r}")
