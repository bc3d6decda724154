"""kvtool below LMCache: an L2 adapter for LMCache's multi-process server (LMCache 0.5.6).

One ``--l2-adapter`` argument adds it; docs/LMCACHE.md has the command lines::

    lmcache server --l2-adapter '{"type": "plugin", "module_path": "kvtool.integrations.lmcache",
        "class_name": "KvtoolL2Adapter", "adapter_params": {"store": "file:///var/cache/kvtool"}}'

LMCache finds the config class ``KvtoolL2AdapterConfig`` beside the adapter by
its name. Importing this package imports LMCache (and torch, which LMCache needs).
"""

from kvtool.integrations.lmcache.adapter import KvtoolL2Adapter, KvtoolL2AdapterConfig

__all__ = ["KvtoolL2Adapter", "KvtoolL2AdapterConfig"]
