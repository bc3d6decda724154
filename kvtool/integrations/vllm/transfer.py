"""Worker-side moves between a kvtool store and vLLM's paged KV tensors, through ``kvtool.entries``.

``Restore`` opens a step's entries (one fetch each, ``entries.open_entry``) and
restores them into the paged tensors. On a CPU cache restored before the
forward pass, each entry decodes straight into its paged blocks at once. With
overlap, a background thread decodes layer by layer while the model runs, and
the forward pass waits only for the layer it is about to run (``copy_layer``):
on a CPU cache each layer decodes straight into the pages; on CUDA, entries the
GPU decodes (a recipe whose codec ``gpu_decodes``) go to the GPU pages stored
and are decoded there, layer by layer on side streams (``kvtool.gpu.pages``),
and other entries decode on the CPU into pinned staging in block order, which
``copy_layer`` moves to the device and scatters there.

``Capture`` copies a step's finished prompt blocks out of the paged tensors
right after each layer is written; ``encode_and_store`` then codes and stores
them off the forward path (``entries.put_cache``). The copies are taken before
the step ends, so vLLM may reuse the blocks at once.

A restore that fails for any reason (entry missing or damaged, a store that
is down, an entry that does not fit the model) marks the blocks of that entry
and of every later entry of the request as failed; the connector reports them
to vLLM, which recomputes them. Wrong KV is never left for the model to use.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence, cast

import numpy as np
import torch

from kvtool import gpu
from kvtool.cache import KVCache, ModelFacts
from kvtool.destinations import Destination
from kvtool.dtypes import dtype_of
from kvtool.entries import Expected, Miss, Opened, Restored, open_entry, put_cache
from kvtool.integrations.vllm.device_capture import DeviceCapture
from kvtool.integrations.vllm.kv_groups import SKIPPED
from kvtool.integrations.vllm.paged import BlockView, gather_blocks, grouped_blocks, put_blocks, to_numpy
from kvtool.integrations.vllm.plan import LoadJob, SaveJob
from kvtool.integrations.vllm.stats import StatsCollector
from kvtool.store import Store
from kvtool.torchbits import PagedViews, numpy_dtype, paged_blocks

if TYPE_CHECKING:
    from kvtool.gpu.pages import GpuEntryPages, GpuPages

#: How a restore's miss is counted among the restore failures (``stats.FAILURE_CAUSES``).
FAILURE_OF_MISS = {Miss.MISSING: "missing", Miss.DAMAGED: "damaged", Miss.UNREACHABLE: "store_error",
                   Miss.MISMATCH: "mismatch", Miss.UNDECODABLE: "decode_error"}

log = logging.getLogger("kvtool.vllm")


@dataclass
class PagedLayers:
    """The registered layers, in model order, as K/V block views, with the KV cache group of each
    (the index of its block list in a job's ``block_ids``; all 0 when not given)."""

    names: list[str]
    keys: list[BlockView]
    values: list[BlockView]
    block_size: int
    dtype: torch.dtype
    groups: list[int] = field(default_factory=list)

    def index(self, name: str) -> int:
        return self._positions[name]

    def group(self, index: int) -> int:
        return self.groups[index] if self.groups else 0

    def __post_init__(self) -> None:
        self._positions = {name: i for i, name in enumerate(self.names)}

    @property
    def heads(self) -> int:
        return int(self.keys[0].shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.keys[0].shape[3])

    @functools.cached_property
    def on_cpu(self) -> bool:
        return all(k.device.type == "cpu" for k in self.keys)

    @functools.cached_property
    def token_rows(self) -> bool:
        """Whether every view's blocks are token rows (none is a ``TiledBlocks`` of vLLM's CPU kernels)."""
        return all(isinstance(view, torch.Tensor) for view in self.keys + self.values)

    @functools.cached_property
    def direct(self) -> bool:
        """Whether a restore decodes straight into the pages: CPU pages of token rows (``paged``)."""
        return self.on_cpu and self.token_rows

    @functools.cached_property
    def paged(self) -> PagedViews:
        """Where the K then V views of every layer lie in their storages (CPU token rows: ``direct``), read once."""
        return PagedViews.of([view for pair in zip(self.keys, self.values) for view in pair])

    def blocks(self, job: LoadJob, layer: int | None = None) -> Destination:
        """The restore destination of ``job``'s entry in these pages (every layer, or one): the tokens of its blocks
        past the first ``first_block``, which vLLM already holds (``tokens(job)``); with several KV cache groups each
        layer's in its group's blocks, those vLLM does not keep left out."""
        picked = None if layer is None else [2 * layer, 2 * layer + 1]
        if len(job.block_ids) > 1 or SKIPPED in job.block_ids[0]:
            views = picked or list(range(2 * len(self.names)))
            return grouped_blocks(self.paged, [self.group(v // 2) for v in views], job.block_ids, self.block_size, views)
        return self.paged.blocks(job.block_ids[0], 0, picked)

    def tokens(self, job: LoadJob) -> slice:
        """The entry's tokens a restore of ``job`` reads: only the chunks that hold them are decoded."""
        return slice(job.first_block * self.block_size, job.num_blocks * self.block_size)


@dataclass
class _Pending:
    request_id: str
    index: int  # among the request's entries
    job: LoadJob
    opened: Opened | None = None
    tier: str = ""
    gpu: GpuEntryPages | None = None  # its place in the step's GPU decode, when it takes that path


@dataclass
class RestoreTimes:
    """Seconds one step's restore spent in each phase.

    ``total`` is wall time from the start to the last layer copied: with
    overlap it includes the forward pass of the layers before, without it
    (the restore runs before the forward pass) it does not.
    """

    fetch: float = 0.0  # reading entries from the store, checksums verified
    decode: float = 0.0  # decompressing them (on a CPU cache straight into the paged blocks: copy included)
    copy: float = 0.0  # writing decoded arrays into vLLM's paged blocks
    blocked: float = 0.0  # the forward pass waiting for a layer (overlap)
    total: float = 0.0


class Restore:
    """One engine step's restores: start with ``start()``, then ``copy_layer(i)`` for each layer.

    ``stats`` (optional) receives the step's counts and timings; every failure
    is counted there by cause (``metrics.FAILURE_CAUSES``).
    """

    def __init__(
        self,
        store: Store,
        key_of: Callable[[str], str],
        layers: PagedLayers,
        jobs: dict[str, list[LoadJob]],
        stats: StatsCollector | None = None,
        gpu_decode: bool | None = None,
    ) -> None:
        """``gpu_decode``: decode on the GPU where an entry's recipe allows (None: where the paged tensors are
        on CUDA and ``kvtool.gpu`` can run)."""
        self._store = store
        self._key_of = key_of
        self._layers = layers
        self._stats = stats
        self._requests = {rid: [_Pending(rid, i, job) for i, job in enumerate(js)] for rid, js in jobs.items()}
        self._pending = [p for ps in self._requests.values() for p in ps]
        n = len(layers.names)
        self._staged: list[list[tuple[list[int], torch.Tensor]]] = [[] for _ in range(n)]  # CUDA: pinned, block order
        self._ready: list[threading.Event] = []  # per layer, when restoring beside the forward pass
        self._copied = [False] * n
        self._left = n  # layers not yet copied
        self._failed_requests: dict[str, int] = {}  # request -> index of its first failed entry
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.times = RestoreTimes()
        self._started = 0.0
        self._gpu_decode = gpu_decode
        self._gpu: GpuPages | None = None
        self._direct = False

    # -- driving ------------------------------------------------------------------------
    def start(self, background: bool) -> None:
        """Decode on a thread, layer by layer, while the forward pass runs (``background``); or now,
        where a CPU cache lets each entry be decoded straight into its paged blocks."""
        self._started = time.perf_counter()
        self._direct = not background and self._layers.direct
        keys, values = self._layers.keys, self._layers.values
        use_gpu = self._gpu_decode if self._gpu_decode is not None else keys[0].device.type == "cuda" and gpu.status()[0]
        if use_gpu and self._layers.token_rows and not self._direct and len(set(self._layers.groups)) <= 1:  # the GPU pages take one block table
            from kvtool.gpu.pages import GpuPages  # imports Triton

            cuda_keys, cuda_values = cast("list[torch.Tensor]", keys), cast("list[torch.Tensor]", values)
            self._gpu = GpuPages(cuda_keys, cuda_values) if GpuPages.usable(cuda_keys, cuda_values) else None
        if background:
            self._ready = [threading.Event() for _ in self._copied]
            self._thread = threading.Thread(target=self._run, name="kvtool-restore", daemon=True)
            self._thread.start()
        else:
            self._run()

    def copy_layer(self, index: int) -> None:
        """Wait until layer ``index`` is restored; on CUDA, move its staged entries into the paged cache."""
        if self._copied[index]:
            return
        waited = time.perf_counter()
        if self._ready:
            self._ready[index].wait()
        if self._gpu is not None:
            self._gpu.wait_layer(index)
        copying = time.perf_counter()
        self.times.blocked += copying - waited
        for block_ids, staged in self._staged[index]:
            kept = [i for i, b in enumerate(block_ids) if b != SKIPPED]  # blocks vLLM does not keep stay out
            ids = torch.as_tensor([block_ids[i] for i in kept], dtype=torch.long, device=self._layers.keys[index].device)
            for view, blocks in zip((self._layers.keys[index], self._layers.values[index]), staged):
                put_blocks(view, ids, blocks if len(kept) == len(block_ids) else blocks[kept])
        done = time.perf_counter()
        self.times.copy += done - copying
        self._staged[index] = []
        self._copied[index] = True
        self._left -= 1
        if not self._left:
            self.times.total = done - self._started

    def finish(self) -> set[int]:
        """Copy any layer the forward pass did not ask for; the block ids that failed to restore."""
        for index in range(len(self._copied)):
            self.copy_layer(index)
        if self._thread is not None:
            self._thread.join()
        if self._gpu is not None:
            by_index = {p.gpu.index: p for p in self._pending if p.gpu is not None}
            for index, word in self._gpu.failures().items():
                self._fail(by_index[index], f"GPU decode status {word}", "decode_error")
        self._report()
        return self.failed_block_ids()

    def failed_requests(self) -> set[str]:
        with self._lock:
            return set(self._failed_requests)

    def failed_block_ids(self) -> set[int]:
        with self._lock:
            failed = dict(self._failed_requests)
        return {block for rid, first in failed.items() for p in self._requests[rid][first:] for block in p.job.written_blocks()}

    def request_ids(self) -> set[str]:
        """Every request this step restores into."""
        return set(self._requests)

    # -- background work -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            begin = time.perf_counter()
            for p in self._pending:
                self._open(p)
            decoding = time.perf_counter()
            self.times.fetch = decoding - begin
            if self._direct:
                for p in self._pending:
                    self._restore(p, self._layers.blocks(p.job), tokens=self._layers.tokens(p.job))
            else:
                if self._gpu is not None:
                    self._hand_to_gpu(self._gpu)
                if not self._ready:  # before the forward pass: each entry's layers in one decode, into staging
                    self._restore_staged(list(range(len(self._copied))))
                for index in range(len(self._copied)):
                    if self._ready:
                        self._restore_layer(index)
                        self._ready[index].set()
            self.times.decode = time.perf_counter() - decoding
        except BaseException:
            log.exception("kvtool restore failed; the affected blocks will be recomputed")
            for p in self._pending:
                self._fail(p, "restore thread failed", "internal")
        finally:
            for p in self._pending:
                if p.opened is not None:
                    p.opened.close()
            for event in self._ready:
                event.set()

    def _open(self, p: _Pending) -> None:
        if self._is_failed(p):
            return
        layers = self._layers
        shape = (layers.heads, p.job.num_blocks * layers.block_size, layers.head_dim)
        expected = Expected(len(layers.names), shape, dtype_of(numpy_dtype(layers.dtype)).name)
        opened = open_entry(self._store, self._key_of(p.job.entry_id), expected)
        if isinstance(opened, Restored):
            self._failed(p, opened)
            return
        p.opened, p.tier = opened, opened.tier or ""

    def _restore(self, p: _Pending, destination: Destination, layers: Sequence[int] | None = None,
                 tokens: slice | None = None) -> None:
        if p.opened is None or self._is_failed(p):
            return
        restored = p.opened.restore(destination, layers, tokens)
        if not restored.ok:
            self._failed(p, restored, f"layer {layers[0]}: " if layers else "")

    def _hand_to_gpu(self, pages: GpuPages) -> None:
        """Give the GPU pages every opened entry of a recipe they decode, stored; queue every layer."""
        for p in self._pending:
            if p.opened is None or self._is_failed(p):
                continue
            destination = pages.entry(p.job.block_ids[0], p.job.first_block)
            if destination.takes_stored(p.opened.reader.recipe):
                p.gpu = destination
                self._restore(p, destination)
                p.opened.close()
                p.opened = None
        pages.start()

    def _restore_layer(self, index: int) -> None:
        """Layer ``index`` of every entry the CPU decodes: straight into the pages where they are token rows on the
        CPU (``PagedLayers.direct``), else into staging in block order for ``copy_layer``."""
        layers = self._layers
        if not layers.direct:
            self._restore_staged([index])
            return
        for p in self._pending:
            if p.opened is not None and not self._is_failed(p):
                self._restore(p, layers.blocks(p.job, index), [index], layers.tokens(p.job))

    def _restore_staged(self, picked: list[int]) -> None:
        """Layers ``picked`` of every entry the CPU decodes, each entry in one decode into staging (pinned where CUDA
        runs) in block order, which ``copy_layer`` moves into the pages."""
        layers = self._layers
        for p in self._pending:
            if p.opened is None or self._is_failed(p):
                continue
            n, bs = p.job.restored_blocks, layers.block_size
            staging = torch.empty((len(picked), 2, n, layers.heads, bs, layers.head_dim), dtype=layers.dtype,
                                  pin_memory=torch.cuda.is_available())
            self._restore(p, paged_blocks(list(staging.flatten(0, 1)), range(n)), picked, layers.tokens(p.job))
            if not self._is_failed(p):
                for index, pair in zip(picked, staging):
                    self._staged[index].append((list(p.job.block_ids[layers.group(index)]), pair))

    def _failed(self, p: _Pending, restored: Restored, where: str = "") -> None:
        assert restored.miss is not None
        self._fail(p, f"{where}entry {restored.miss.value}" + (f": {restored.detail}" if restored.detail else ""),
                   FAILURE_OF_MISS[restored.miss])

    def _fail(self, p: _Pending, reason: str, cause: str) -> None:
        with self._lock:
            known = self._failed_requests.get(p.request_id)
            if known is None or p.index < known:
                self._failed_requests[p.request_id] = p.index
        if self._stats is not None:
            self._stats.count("restore_failures", 1, cause)
        log.warning("request %s: cannot restore entry %s (%s); vLLM will recompute it", p.request_id, p.job.entry_id[:16], reason)

    def _is_failed(self, p: _Pending) -> bool:
        with self._lock:
            first = self._failed_requests.get(p.request_id)
        return first is not None and p.index >= first

    def _report(self) -> None:
        """Count the step in ``stats`` and log each request's restore at DEBUG."""
        t = self.times
        restored_tokens = restored_entries = failed_tokens = 0
        for rid, items in self._requests.items():
            ok = items[: self._failed_requests.get(rid, len(items))]
            tokens = sum(p.job.restored_blocks for p in ok) * self._layers.block_size
            restored_tokens += tokens
            restored_entries += len(ok)
            failed_tokens += sum(p.job.restored_blocks for p in items[len(ok):]) * self._layers.block_size
            tiers = ",".join(sorted({p.tier for p in ok if p.tier})) or "-"
            log.debug(
                "request %s: restored %d tokens from %s in %.1f ms (fetch %.1f ms, decode %.1f ms, copy %.1f ms; "
                "forward waited %.1f ms)%s",
                rid, tokens, tiers, t.total * 1e3, t.fetch * 1e3, t.decode * 1e3, t.copy * 1e3, t.blocked * 1e3,
                f"; {len(items) - len(ok)} entries failed, recomputing" if len(ok) < len(items) else "",
            )
        if self._stats is not None:
            self._stats.count("tokens_restored", restored_tokens)
            self._stats.count("entries_restored", restored_entries)
            self._stats.count("tokens_failed", failed_tokens)
            for name, seconds in (("restore_seconds", t.total), ("restore_fetch_seconds", t.fetch),
                                  ("restore_decode_seconds", t.decode), ("restore_copy_seconds", t.copy)):
                self._stats.observe(name, seconds)


@dataclass
class Capture:
    """One engine step's prompt blocks to save, copied out layer by layer."""

    jobs: dict[str, list[SaveJob]]
    num_layers: int
    arrays: dict[str, list[list[np.ndarray | None]]] = field(default_factory=dict)  # entry -> [keys, values]
    device: DeviceCapture | None = None  # CUDA: copies in flight on a side stream

    def take_layer(self, index: int, layers: PagedLayers) -> None:
        key_view, value_view = layers.keys[index], layers.values[index]
        if key_view.device.type == "cuda" and self.device is None:
            self.device = DeviceCapture(key_view.device)
        for job in (j for js in self.jobs.values() for j in js):
            k, v = self.arrays.setdefault(job.entry_id, [[None] * self.num_layers, [None] * self.num_layers])
            block_ids = job.block_ids[layers.group(index)]
            if self.device is not None and isinstance(key_view, torch.Tensor) and isinstance(value_view, torch.Tensor):
                k[index] = to_numpy(self.device.gather(key_view, block_ids))
                v[index] = to_numpy(self.device.gather(value_view, block_ids))
            else:
                k[index] = gather_blocks(key_view, block_ids)
                v[index] = gather_blocks(value_view, block_ids)

    def complete_entries(self, skip_requests: set[str]) -> list[tuple[str, int, list[np.ndarray], list[np.ndarray]]]:
        """Entries with every layer captured, except those of ``skip_requests`` (waits for copies in flight): id,
        first token, keys, values."""
        if self.device is not None:
            self.device.finish()
        done: list[tuple[str, int, list[np.ndarray], list[np.ndarray]]] = []
        for rid, jobs in self.jobs.items():
            if rid in skip_requests:
                continue
            for job in jobs:
                k, v = self.arrays.get(job.entry_id, [[None], [None]])
                if all(a is not None for a in k + v):
                    done.append((job.entry_id, job.first_token, cast("list[np.ndarray]", k), cast("list[np.ndarray]", v)))
        return done


def encode_and_store(
    store: Store, key: str, keys: Sequence[np.ndarray], values: Sequence[np.ndarray], recipe: str, facts: ModelFacts,
    first_token: int = 0,
) -> int:
    """Code one entry (all layers, from prompt position ``first_token``) with ``recipe`` and store it; its size, 0 if
    it was not stored."""
    cache = KVCache(list(keys), list(values), facts, {"source": "vllm"}, token_start=first_token)
    put = put_cache(store, key, cache, recipe)
    return put.stored_bytes
