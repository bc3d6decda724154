"""The cells of the L2 benchmark (where offload is deployed) and the configurations each compares.

A cell names what its three parts run: the adapters of the chunk part, the vLLM
offloading tiers of the tier part and the served configurations of the trace part
(the reference, vLLM's own prefix cache, last), and how the L2 is placed:

- ``warm``: a local folder, its files in the page cache (they were just written);
- ``cold``: the same, the page cache of the L2's files dropped before each load phase;
- ``capacity``: the same warm folder, every L2 held to one byte budget, a share of the
  raw bytes the trace's sessions store (``--budget-fraction``);
- ``remote``: kvtool's Redis tier on the far side of a shaped link (``link.py``),
  compressed against the same adapter storing raw (recipe ``none``); LMCache's
  multi-process server has no Redis L2 of its own to compare.

``Place`` is where one configuration keeps its L2 in a cell; the spec builders turn a
configuration's name and its place into LMCache's ``--l2-adapter`` JSON, or the store
URL of a kvtool integration. (No ``from __future__ import annotations``: the dataclasses here
are also loaded by file path, outside any package, by tests/test_benchmark_scripts.py.)
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

#: kvtool's L2 adapter, as LMCache's ``plugin`` type loads it.
KVTOOL = {"type": "plugin", "module_path": "kvtool.integrations.lmcache", "class_name": "KvtoolL2Adapter"}
TIMED = {"type": "plugin", "module_path": "benchmarks.lmcache_l2.timed_adapter", "class_name": "TimedL2Adapter"}
#: LMCache's L2 eviction for a budgeted adapter: checked every second, from the first byte over the budget,
#: a tenth of the adapter's chunks (its least recently used) at a time.
EVICTION = {"eviction_policy": "LRU", "trigger_watermark": 1.0, "eviction_ratio": 0.1}
REFERENCE = "vllm-prefix"


@dataclass(frozen=True)
class Cell:
    name: str
    chunks: tuple[str, ...]  # chunk part: adapters alone
    tiers: tuple[str, ...]  # tier part: vLLM offloading tiers
    trace: tuple[str, ...]  # trace part: served configurations, the reference last
    cold: bool = False  # drop the L2's page cache before each load phase
    budgeted: bool = False  # every L2 held to --budget-fraction of the trace's raw bytes
    remote: bool = False  # the L2 is a Redis server across a shaped link


LOCAL_TRACE = ("fs", "kvtool", "kvtool-connector", REFERENCE)
CELLS = {
    "warm": Cell("warm", ("fs", "kvtool", "kvtool-none"), ("vllm-fs", "kvtool-tier", "kvtool-tier-none"), LOCAL_TRACE),
    "cold": Cell("cold", ("fs", "kvtool", "kvtool-none"), ("vllm-fs", "kvtool-tier", "kvtool-tier-none"), LOCAL_TRACE,
                 cold=True),
    "capacity": Cell("capacity", (), (), LOCAL_TRACE, budgeted=True),
    "remote": Cell("remote", ("kvtool-redis", "kvtool-redis-none"), ("kvtool-tier-redis", "kvtool-tier-redis-none"),
                   ("kvtool-redis", "kvtool-redis-none", REFERENCE), remote=True),
}


@dataclass
class Place:
    """Where one configuration keeps its L2 in a cell: a folder, or a Redis server's URL."""

    folder: Path | None = None
    redis: str | None = None
    budget_bytes: int = 0  # 0: unbounded

    def file_url(self) -> str:
        assert self.folder is not None
        return f"file://{self.folder}" + (f"?capacity={self.budget_bytes}" if self.budget_bytes else "")

    def store_url(self) -> str:
        return self.redis if self.redis is not None else self.file_url()


def _kvtool(store: str, recipe: str | None = None) -> dict[str, Any]:
    return {**KVTOOL, "adapter_params": {"store": store, **({"recipe": recipe} if recipe else {})}}


#: LMCache adapter name -> its own ``--l2-adapter`` spec at a place (unbounded: a budget is LMCache's to enforce).
ADAPTERS: dict[str, Callable[[Place], dict[str, Any]]] = {
    "fs": lambda p: {"type": "fs", "base_path": str(p.folder)},
    "kvtool": lambda p: _kvtool(f"file://{p.folder}"),
    "kvtool-none": lambda p: _kvtool(f"file://{p.folder}", "none"),
    "kvtool-redis": lambda p: _kvtool(str(p.redis)),
    "kvtool-redis-none": lambda p: _kvtool(str(p.redis), "none"),
}


def lmcache_spec(name: str, place: Place, timings: Path) -> dict[str, Any]:
    """The adapter inside the timing wrapper; with a budget, declared to LMCache's L2 eviction."""
    spec: dict[str, Any] = {**TIMED, "adapter_params": {"inner": ADAPTERS[name](place), "timings": str(timings),
                                                       "capacity_bytes": place.budget_bytes}}
    if place.budget_bytes:
        spec["eviction"] = dict(EVICTION)
    return spec


def connector_store(place: Place, l1_bytes: int) -> str:
    """kvtool's connector over the same two levels as LMCache: a memory tier of L1's size over the cell's L2."""
    return f"memory://?capacity={l1_bytes},{place.store_url()}"


#: vLLM offloading tier name -> (kvtool recipe, or None for vLLM's own fs tier; Redis or not).
TIERS: dict[str, tuple[str | None, bool]] = {
    "vllm-fs": (None, False),
    "kvtool-tier": ("exphuff", False),
    "kvtool-tier-none": ("none", False),
    "kvtool-tier-redis": ("exphuff", True),
    "kvtool-tier-redis-none": ("none", True),
}
