"""LMCache's side of an L2 adapter's calls, as its store and prefetch controllers make them, for the adapter's tests.

An adapter is made from the ``--l2-adapter`` JSON by LMCache's own parser and factory; each call submits a task and
waits on that kind's event fd for its result, as the controllers poll them.
"""

from __future__ import annotations

import argparse
import json
import select
import time
from typing import Any

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def key(n: int, salt: str = "", rank: int = 0, model: str = MODEL) -> ObjectKey:
    return ObjectKey(chunk_hash=n.to_bytes(16, "big"), model_name=model, kv_rank=rank, cache_salt=salt)


def adapter_of(params: dict) -> Any:
    spec = {"type": "plugin", "module_path": "kvtool.integrations.lmcache", "class_name": "KvtoolL2Adapter",
            "adapter_params": params}
    config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)])).adapters[0]
    return create_l2_adapter(config)


def wait(query, task, fd: int, timeout: float = 60.0):
    """The task's result once its event fd has been signalled."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = query(task)
        if result is not None:
            return result
        select.select([fd], [], [], 0.05)
    raise AssertionError(f"task {task} did not finish in {timeout} s")


def store(adapter, keys, objs):
    """The ``L2StoreResult`` of one store task."""
    task = adapter.submit_store_task(keys, objs)
    fd = adapter.get_store_event_fd()
    deadline = time.monotonic() + 60
    done: dict = {}
    while task not in done and time.monotonic() < deadline:
        select.select([fd], [], [], 0.05)
        done.update(adapter.pop_completed_store_tasks())
    return done[task]


def bits(bitmap, n: int) -> list[bool]:
    found = set(bitmap.get_indices_list())
    return [i in found for i in range(n)]


def lookup(adapter, keys) -> list[bool]:
    task = adapter.submit_lookup_and_lock_task(keys, {})
    return bits(wait(adapter.query_lookup_and_lock_result, task, adapter.get_lookup_and_lock_event_fd()), len(keys))


def load(adapter, keys, objs) -> list[bool]:
    task = adapter.submit_load_task(keys, objs)
    return bits(wait(adapter.query_load_result, task, adapter.get_load_event_fd()), len(keys))


class Listener:
    """What an adapter told LMCache's controllers: keys stored (with sizes), accessed and deleted."""

    def __init__(self) -> None:
        self.stored: list[tuple[ObjectKey, int]] = []
        self.accessed: list[ObjectKey] = []
        self.deleted: list[ObjectKey] = []

    def on_l2_keys_stored(self, keys, sizes):
        self.stored.extend(zip(keys, sizes))

    def on_l2_keys_accessed(self, keys):
        self.accessed.extend(keys)

    def on_l2_keys_deleted(self, keys):
        self.deleted.extend(keys)
