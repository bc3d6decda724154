"""Entries restored into paged KV tensors on the GPU, layer by layer, beside the forward pass.

``LayerwiseDecode`` takes a step's entries (their exphuff-lanes chunks as host
bytes, and where each (head, token) row of each layer goes), lays the chunks
out layer by layer in one pinned host buffer, and queues for each layer a
host-to-device copy on a copy stream and the decode on a decode stream that
waits only for that layer's copy. The forward pass waits (``wait_layer``) only
for the layer it is about to run; the host never waits for the device until
``failures()``, which reads every chunk's status at the end of the step. Layers
take ``DECODE_STREAMS`` decode streams in turn, so a few decode at once.

On CPU tensors (Triton's interpreter, for tests) the same steps run in order,
without streams or pinned memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtool.gpu.decode import ELEMENT, Batch, Scratch, describe, run_kernels

#: Layers decode on this many streams in turn, so several layers' kernels share the GPU: one
#: layer of a step is a few thousand lanes, too few to fill it alone.
DECODE_STREAMS = 4


@dataclass(frozen=True)
class EntryChunks:
    """One entry as the GPU restore needs it.

    ``data`` holds the entry's bytes; chunk ``i`` is ``data[offset[i]:offset[i] + length[i]]``, tokens
    ``[token_start[i], token_start[i] + tokens[i])`` of layer position ``layer[i]``'s keys (``kind`` 0) or
    values (1), ``stored_raw`` where the container stored it as its values. ``rows[kind]`` (``[heads, tokens]``) is each row's element offset from the start of that
    layer's key or value view (the same for every layer), -1 for a row left out.
    """

    data: np.ndarray  # uint8
    layer: np.ndarray
    kind: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    tokens: np.ndarray
    token_start: np.ndarray
    stored_raw: np.ndarray
    rows: np.ndarray  # [2, heads, tokens] int64


def flat_storage(view: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``view`` as a flat tensor of unsigned integers of its element size."""
    whole = torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage())
    return whole.view(ELEMENT[view.element_size()])


class LayerwiseDecode:
    """One step's GPU restores into ``keys[l]`` / ``values[l]`` (``[blocks, heads, block_size, dim]`` views).

    Make it on the thread of the forward pass: the decodes wait for the work queued there so far (an earlier
    step may still write the blocks this one restores), never for work queued after.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], dtype_name: str) -> None:
        self._keys, self._values = keys, values
        self._dtype_name = dtype_name
        self._heads, self._dim = keys[0].shape[1], keys[0].shape[3]
        self._device = keys[0].device
        self._cuda = self._device.type == "cuda"
        self._entries: list[EntryChunks] = []
        self._ready: list[torch.cuda.Event] = []
        self._held: list[object] = []  # host and device buffers in use until the step ends
        self._chunk_entry = np.zeros(0, np.int64)
        self._scratch: Scratch | None = None
        self._streams: list[torch.cuda.Stream] = []
        self._begin = None
        if self._cuda:
            self._begin = torch.cuda.Event()
            self._begin.record(torch.cuda.current_stream(self._device))

    def add(self, entry: EntryChunks) -> int:
        self._entries.append(entry)
        return len(self._entries) - 1

    def start(self) -> None:
        """Queue every layer's copy and decode."""
        layers = len(self._keys)
        if not self._entries:
            return
        # Chunks in (layer, kind, entry, token) order: each layer's bytes are one run of the host buffer.
        cols = [(e, np.arange(len(x.layer))) for e, x in enumerate(self._entries)]
        entry_of = np.concatenate([np.full(len(i), e) for e, i in cols])
        index = np.concatenate([i for _, i in cols])
        layer = np.concatenate([x.layer for x in self._entries])
        kind = np.concatenate([x.kind for x in self._entries])
        start = np.concatenate([x.token_start for x in self._entries])
        order = np.lexsort((start, entry_of, kind, layer))
        entry_of, index, layer, kind = entry_of[order], index[order], layer[order], kind[order]
        length = np.array([self._entries[e].length[i] for e, i in zip(entry_of, index)], np.int64)
        tokens = np.array([self._entries[e].tokens[i] for e, i in zip(entry_of, index)], np.int64)
        stored_raw = np.array([self._entries[e].stored_raw[i] for e, i in zip(entry_of, index)], np.int64)
        offset = np.cumsum(length) - length
        host = torch.empty(int(length.sum()), dtype=torch.uint8, pin_memory=self._cuda)
        flat = host.numpy()
        for at, e, i, n in zip(offset, entry_of, index, length):
            source = int(self._entries[e].offset[i])
            flat[at : at + n] = self._entries[e].data[source : source + n]
        rows, row_start = self._row_table(entry_of, index, kind)
        batch = describe(flat, offset, length, tokens, row_start, self._dtype_name, self._heads, self._dim, stored_raw)
        self._chunk_entry = entry_of
        bounds = np.searchsorted(layer * 2 + kind, np.arange(2 * layers + 1))  # chunks of (layer, kind)
        if self._cuda:
            with torch.cuda.device(self._device):
                self._start_cuda(host, batch, rows, offset, length, bounds)
        else:
            self._scratch = Scratch.for_batch(batch, self._device)
            for l in range(layers):
                self._decode_layer(l, host, batch, rows, bounds)

    def _row_table(self, entry_of: np.ndarray, index: np.ndarray, kind: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One row table for every layer: each (entry, kind, token block) once; each chunk's start in it."""
        parts: list[np.ndarray] = []
        starts: dict[tuple[int, int, int], int] = {}
        row_start = np.zeros(len(entry_of), np.int64)
        at = 0
        for c, (e, i, k) in enumerate(zip(entry_of, index, kind)):
            x = self._entries[e]
            key = (int(e), int(k), int(x.token_start[i]))
            if key not in starts:
                first = int(x.token_start[i])
                parts.append(x.rows[k][:, first : first + int(x.tokens[i])].reshape(-1))
                starts[key] = at
                at += parts[-1].size
            row_start[c] = starts[key]
        return (np.concatenate(parts) if parts else np.zeros(0, np.int64)).astype(np.int64), row_start

    def _start_cuda(self, host: torch.Tensor, batch: Batch, rows: np.ndarray, offset: np.ndarray,
                    length: np.ndarray, bounds: np.ndarray) -> None:
        copy_stream = torch.cuda.Stream(self._device)
        decode_streams = [torch.cuda.Stream(self._device) for _ in range(DECODE_STREAMS)]
        self._streams = [copy_stream, *decode_streams]
        with torch.cuda.stream(copy_stream):
            device_bytes = torch.empty(host.numel(), dtype=torch.uint8, device=self._device)
            rows_dev = torch.from_numpy(rows).pin_memory().to(self._device, non_blocking=True)
            self._scratch = Scratch.for_batch(batch, self._device)
            tables_ready = torch.cuda.Event()
            tables_ready.record(copy_stream)
            copied = []
            for l in range(len(self._keys)):
                lo, hi = bounds[2 * l], bounds[2 * l + 2]
                if hi > lo:
                    a, b = int(offset[lo]), int(offset[hi - 1] + length[hi - 1])
                    device_bytes[a:b].copy_(host[a:b], non_blocking=True)
                event = torch.cuda.Event()
                event.record(copy_stream)
                copied.append(event)
        for stream in decode_streams:
            stream.wait_event(tables_ready)
            stream.wait_event(self._begin)
        for l in range(len(self._keys)):
            stream = decode_streams[l % DECODE_STREAMS]
            with torch.cuda.stream(stream):
                stream.wait_event(copied[l])
                self._decode_layer(l, device_bytes, batch, rows_dev, bounds)
                ready = torch.cuda.Event()
                ready.record(stream)
                self._ready.append(ready)
        self._held += [host, device_bytes, rows_dev]

    def _decode_layer(self, l: int, src: torch.Tensor, batch: Batch, rows: np.ndarray | torch.Tensor, bounds: np.ndarray) -> None:
        assert self._scratch is not None
        if not isinstance(rows, torch.Tensor):
            rows = torch.from_numpy(rows)
        for kind, view in enumerate((self._keys[l], self._values[l])):
            lo, hi = int(bounds[2 * l + kind]), int(bounds[2 * l + kind + 1])
            if hi > lo:
                run_kernels(src, batch, self._scratch, lo, hi, rows, flat_storage(view), view.storage_offset(),
                            self._dtype_name, self._heads, self._dim)

    def wait_layer(self, l: int) -> None:
        """Make the current stream (the forward pass) wait until layer ``l`` is in place; the host does not wait."""
        if l < len(self._ready):  # fewer when queueing failed part way: then every entry fails
            torch.cuda.current_stream(self._device).wait_event(self._ready[l])

    def failures(self) -> dict[int, int]:
        """Entries (by ``add`` index) whose chunks did not decode, with the first bad status word; waits for the device."""
        if self._scratch is None:
            return {}
        for stream in self._streams:
            stream.synchronize()
        words = self._scratch.status.cpu().numpy()
        failed: dict[int, int] = {}
        for c in np.flatnonzero(words):
            failed.setdefault(int(self._chunk_entry[c]), int(words[c]))
        self._held.clear()
        return failed

