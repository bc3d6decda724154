"""kvtool below LMCache: an L2 adapter for LMCache's multi-process server (LMCache 0.5.6).

One ``--l2-adapter`` argument adds it; docs/LMCACHE.md has the command lines::

    lmcache server --l2-adapter '{"type": "plugin", "module_path": "kvtool.integrations.lmcache",
        "class_name": "KvtoolL2Adapter", "adapter_params": {"store": "file:///var/cache/kvtool"}}'

LMCache finds the config class ``KvtoolL2AdapterConfig`` beside the adapter by
its name. The two classes import LMCache (and torch) when first asked for; the
modules that map chunks to caches and keys (``chunks``, ``naming``, ``settings``)
need neither.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KvtoolL2Adapter", "KvtoolL2AdapterConfig"]


def __getattr__(name: str) -> Any:  # the two classes, imported when first asked for
    if name in __all__:
        return getattr(importlib.import_module("kvtool.integrations.lmcache.adapter"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
