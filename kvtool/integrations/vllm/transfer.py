"""Worker-side moves between a kvtool store and vLLM's paged KV tensors.

``Restore`` fetches a step's entries and decodes them layer by layer on a
background thread; the model's forward pass waits only for the layer it is
about to run (``copy_layer``), so decoding layer ``i + 1`` overlaps computing
layer ``i``. The copy into the paged tensor happens on the caller's thread,
ordered with the model's own work on any device.

``Capture`` copies a step's finished prompt blocks out of the paged tensors
right after each layer is written; ``encode_and_store`` then compresses and
stores them off the forward path. The copies are taken before the step ends,
so vLLM may reuse the blocks at once.

On CUDA, entries the GPU decodes (``exphuff-lanes``) go from pinned memory to
the device and are decoded there into the paged blocks, layer by layer on side
streams (``kvtool.gpu.restore``), the forward pass's stream waiting on the
device; other entries take the CPU decode. Capture copies to pinned memory on
a side stream.

A restore that fails for any reason (entry missing or damaged, a store that
is down, an entry that does not fit the model) marks the blocks of that entry
and of every later entry of the request as failed; the connector reports them
to vLLM, which recomputes them. Wrong KV is never left for the model to use.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence, cast

import numpy as np
import torch

from kvtool.cache import KVCache, ModelFacts
from kvtool.kvz import KvzReader, encode_cache
from kvtool.errors import KvtoolError
from kvtool import gpu
from kvtool.integrations.vllm.device_capture import DeviceCapture
from kvtool.integrations.vllm.stats import StatsCollector
from kvtool.integrations.vllm.paged import from_numpy, gather_blocks, row_offsets, scatter_blocks, storage_bytes, to_numpy
from kvtool.integrations.vllm.plan import LoadJob, SaveJob
from kvtool.store import MissCause, Store

# How a store's reason for a miss is counted among the restore failures (``stats.FAILURE_CAUSES``).
FAILURE_OF_MISS = {MissCause.MISSING: "missing", MissCause.DAMAGED: "damaged", MissCause.UNREACHABLE: "store_error"}

if TYPE_CHECKING:
    from kvtool.gpu.restore import LayerwiseDecode

log = logging.getLogger("kvtool.vllm")


@dataclass
class PagedLayers:
    """The registered layers, in model order, as K/V block views."""

    names: list[str]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    block_size: int
    dtype: torch.dtype

    def index(self, name: str) -> int:
        return self._positions[name]

    def __post_init__(self) -> None:
        self._positions = {name: i for i, name in enumerate(self.names)}

    @property
    def heads(self) -> int:
        return self.keys[0].shape[1]

    @property
    def head_dim(self) -> int:
        return self.keys[0].shape[3]


@dataclass
class _Pending:
    request_id: str
    job: LoadJob
    reader: KvzReader | None = None
    tier: str = ""
    data: bytes | memoryview = b""  # the entry's bytes, for the GPU decoder
    gpu_index: int = -1  # its index in the step's GPU decode, when it takes that path


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
        self._pending = [_Pending(rid, job) for rid, js in jobs.items() for job in js]
        n = len(layers.names)
        self._decoded: list[list[tuple[list[int], torch.Tensor, torch.Tensor]] | None] = [None] * n
        self._ready = [threading.Event() for _ in range(n)]
        self._copied = [False] * n
        self._failed_requests: dict[str, int] = {}  # request -> index of its first failed job
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.times = RestoreTimes()
        self._started = 0.0
        self._gpu_decode = gpu_decode
        self._gpu: LayerwiseDecode | None = None

    # -- driving ------------------------------------------------------------------------
    def start(self, background: bool) -> None:
        """Decode on a thread, layer by layer, while the forward pass runs (``background``); or now,
        where a CPU cache lets each entry be decoded straight into its paged blocks."""
        self._started = time.perf_counter()
        self._direct = not background and all(k.device.type == "cpu" for k in self._layers.keys)
        keys, values = self._layers.keys, self._layers.values
        use_gpu = self._gpu_decode if self._gpu_decode is not None else keys[0].is_cuda and gpu.status()[0]
        if use_gpu and not self._direct:
            from kvtool.integrations.vllm import gpu_transfer  # imports Triton

            self._gpu = gpu_transfer.new_decoder(keys, values) if gpu_transfer.gpu_usable(keys, values) else None
        if background:
            self._thread = threading.Thread(target=self._run, name="kvtool-restore", daemon=True)
            self._thread.start()
        else:
            self._run()

    def copy_layer(self, index: int) -> None:
        """Wait until layer ``index`` is decoded, then write it into the paged cache."""
        if self._copied[index]:
            return
        waited = time.perf_counter()
        self._ready[index].wait()
        if self._gpu is not None:
            self._gpu.wait_layer(index)
        copying = time.perf_counter()
        self.times.blocked += copying - waited
        for block_ids, k, v in self._decoded[index] or ():
            scatter_blocks(self._layers.keys[index], block_ids, k)
            scatter_blocks(self._layers.values[index], block_ids, v)
        done = time.perf_counter()
        self.times.copy += done - copying
        self._decoded[index] = None
        self._copied[index] = True
        if all(self._copied):
            self.times.total = done - self._started

    def finish(self) -> set[int]:
        """Copy any layer the forward pass did not ask for; the block ids that failed to restore."""
        for index in range(len(self._copied)):
            self.copy_layer(index)
        if self._thread is not None:
            self._thread.join()
        if self._gpu is not None:
            by_index = {p.gpu_index: p for p in self._pending if p.gpu_index >= 0}
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
        blocks: set[int] = set()
        for rid, first in failed.items():
            for p in self._jobs_of(rid)[first:]:
                blocks.update(p.job.block_ids)
        return blocks

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
                    self._decode_into_pages(p)
            else:
                if self._gpu is not None:
                    from kvtool.integrations.vllm.gpu_transfer import hand_over

                    hand_over(self._gpu, self._pending, self._layers, self._fail, self._is_failed)
                for index in range(len(self._ready)):
                    self._decoded[index] = self._decode_layer(index)
                    self._ready[index].set()
            self.times.decode = time.perf_counter() - decoding
        except BaseException:
            log.exception("kvtool restore failed; the affected blocks will be recomputed")
            for p in self._pending:
                self._fail(p, "restore thread failed", "internal")
        finally:
            for event in self._ready:
                event.set()

    def _open(self, p: _Pending) -> None:
        if self._is_failed(p):
            return
        key = self._key_of(p.job.entry_id)
        try:
            p.tier = self._store.tier_of(key) or ""
            fetched = self._store.fetch(key)
            entry = fetched.entry
            if entry is None:
                assert fetched.cause is not None
                self._fail(p, f"entry {fetched.cause.value}" + (f": {fetched.detail}" if fetched.detail else ""),
                           FAILURE_OF_MISS[fetched.cause])
                return
            reader = KvzReader.from_bytes(entry.value)
            p.data = entry.value
        except KvtoolError as exc:
            self._fail(p, str(exc), "store_error")
            return
        expected = (self._layers.heads, p.job.num_blocks * self._layers.block_size, self._layers.head_dim)
        fits = reader.layer_ids == list(range(len(self._layers.names))) and all(
            shape == expected for _, _, shape in reader.tensors
        )
        if not fits:
            reader.close()
            self._fail(p, "entry does not fit this model's KV cache", "mismatch")
            return
        p.reader = reader

    def _decode_into_pages(self, p: _Pending) -> None:
        """Every layer of one entry from its stored chunks into the paged blocks, in one native pass per chunk."""
        if p.reader is None or self._is_failed(p):
            return
        layers, bs = self._layers, self._layers.block_size
        tokens = p.job.num_blocks * bs
        skip = p.job.first_block * bs
        ids = [0] * p.job.first_block + list(p.job.block_ids)  # the skipped blocks' rows are left out
        try:
            rows = np.stack([
                row_offsets(view, ids, tokens, skip)
                for k, v in zip(layers.keys, layers.values) for view in (k, v)
            ])
            p.reader.read_rows([storage_bytes(k) for k in layers.keys], rows, [i // 2 for i in range(2 * len(layers.keys))])
        except KvtoolError as exc:
            self._fail(p, str(exc), "decode_error")
        finally:
            p.reader.close()

    def _decode_layer(self, index: int) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
        out = []
        bs = self._layers.block_size
        for p in self._pending:
            if p.reader is None or self._is_failed(p):
                continue
            try:
                first = p.job.first_block * bs
                k, v = decode_layer(p.reader, index, first, len(p.job.block_ids) * bs, self._layers.dtype)
            except KvtoolError as exc:
                self._fail(p, f"layer {index}: {exc}", "decode_error")
                continue
            out.append((p.job.block_ids, k, v))
            if index == len(self._ready) - 1:
                p.reader.close()
        return out

    def _fail(self, p: _Pending, reason: str, cause: str) -> None:
        position = self._jobs_of(p.request_id).index(p)
        with self._lock:
            known = self._failed_requests.get(p.request_id)
            if known is None or position < known:
                self._failed_requests[p.request_id] = position
        if self._stats is not None:
            self._stats.count("restore_failures", 1, cause)
        log.warning("request %s: cannot restore entry %s (%s); vLLM will recompute it", p.request_id, p.job.entry_id[:16], reason)

    def _is_failed(self, p: _Pending) -> bool:
        with self._lock:
            first = self._failed_requests.get(p.request_id)
        return first is not None and self._jobs_of(p.request_id).index(p) >= first

    def _jobs_of(self, request_id: str) -> list[_Pending]:
        return [q for q in self._pending if q.request_id == request_id]

    def _report(self) -> None:
        """Count the step in ``stats`` and log each request's restore at DEBUG."""
        t = self.times
        restored_tokens = restored_entries = failed_tokens = 0
        for rid in dict.fromkeys(p.request_id for p in self._pending):
            items = self._jobs_of(rid)
            ok = items[: self._failed_requests.get(rid, len(items))]
            tokens = sum(len(p.job.block_ids) for p in ok) * self._layers.block_size
            restored_tokens += tokens
            restored_entries += len(ok)
            failed_tokens += sum(len(p.job.block_ids) for p in items[len(ok):]) * self._layers.block_size
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


def decode_layer(
    reader: KvzReader, layer: int, first_token: int, tokens: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[kv_heads, tokens, head_dim]`` of one layer of an entry, as tensors of ``dtype``.

    The restore path's one decoding call: a decoder that writes straight into
    the paged blocks replaces this function.
    """
    cache = reader.read(layers=[layer], tokens=slice(first_token, first_token + tokens), threads=1)
    return from_numpy(cache.keys[0], dtype), from_numpy(cache.values[0], dtype)


@dataclass
class Capture:
    """One engine step's prompt blocks to save, copied out layer by layer."""

    jobs: dict[str, list[SaveJob]]
    num_layers: int
    arrays: dict[str, list[list[np.ndarray | None]]] = field(default_factory=dict)  # entry -> [keys, values]
    device: DeviceCapture | None = None  # CUDA: copies in flight on a side stream

    def take_layer(self, index: int, layers: PagedLayers) -> None:
        key_view, value_view = layers.keys[index], layers.values[index]
        if key_view.is_cuda and self.device is None:
            self.device = DeviceCapture(key_view.device)
        for job in (j for js in self.jobs.values() for j in js):
            k, v = self.arrays.setdefault(job.entry_id, [[None] * self.num_layers, [None] * self.num_layers])
            if self.device is not None:
                k[index] = to_numpy(self.device.gather(key_view, job.block_ids))
                v[index] = to_numpy(self.device.gather(value_view, job.block_ids))
            else:
                k[index] = gather_blocks(key_view, job.block_ids)
                v[index] = gather_blocks(value_view, job.block_ids)

    def complete_entries(self, skip_requests: set[str]) -> list[tuple[str, list[np.ndarray], list[np.ndarray]]]:
        """Entries with every layer captured, except those of ``skip_requests`` (waits for copies in flight)."""
        if self.device is not None:
            self.device.finish()
        done: list[tuple[str, list[np.ndarray], list[np.ndarray]]] = []
        for rid, jobs in self.jobs.items():
            if rid in skip_requests:
                continue
            for job in jobs:
                k, v = self.arrays.get(job.entry_id, [[None], [None]])
                if all(a is not None for a in k + v):
                    done.append((job.entry_id, cast("list[np.ndarray]", k), cast("list[np.ndarray]", v)))
        return done


def encode_and_store(
    store: Store, key: str, keys: Sequence[np.ndarray], values: Sequence[np.ndarray], recipe: str, facts: ModelFacts
) -> int:
    """Compress one entry (all layers) as a .kvz with ``recipe`` and store it; its size, 0 if the store refused it."""
    cache = KVCache(list(keys), list(values), facts, {"source": "vllm"})
    tokens = cache.num_tokens
    blob = encode_cache(cache, recipe, chunk_tokens=max(1, tokens), threads=1)
    return len(blob) if store.put(key, blob, {"tokens": tokens, "raw_bytes": cache.nbytes}) else 0
