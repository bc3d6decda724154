"""The connector's GPU restore: entries' chunks handed to ``kvtool.gpu.restore``.

Imported only where the GPU path runs (it imports Triton). ``gpu_chunks`` turns an opened entry into what ``kvtool.gpu.restore`` decodes
(its chunk table, checksums verified here, and where each row of each layer
goes), or ``None`` where the GPU decoder does not apply (another recipe, a
dtype it does not write): that entry then takes the CPU
decode, so a step may mix both.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvtool import _native, gpu
from kvtool.kvz import KvzCorruptError, KvzReader
from kvtool.errors import KvtoolError
from kvtool.gpu.restore import EntryChunks, LayerwiseDecode
from kvtool.integrations.vllm.paged import row_offsets
from kvtool.integrations.vllm.plan import LoadJob


def gpu_usable(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> bool:
    """Whether restores into these views can decode on the GPU: CUDA (or the interpreter on CPU tensors), a dtype
    the decoder writes, every layer laid out like the first (one row table serves all)."""
    ok, _ = gpu.status()
    first = keys[0]
    on_device = first.is_cuda or (gpu.interpreted() and first.device.type == "cpu")
    same = all(v.shape == first.shape and v.stride() == first.stride() for v in (*keys, *values))
    return ok and on_device and same and gpu.dtype_name(first.dtype) is not None and first.stride(3) == 1


def new_decoder(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> LayerwiseDecode:
    """A step's GPU decoder into these views (``gpu_usable`` said yes); make it on the forward pass's thread."""
    name = gpu.dtype_name(keys[0].dtype)
    assert name is not None  # gpu_usable checked it
    return LayerwiseDecode(list(keys), list(values), name)


def gpu_chunks(reader: KvzReader, data: bytes | memoryview, layers: Any, job: LoadJob) -> EntryChunks | None:
    """The entry's chunks and where its rows go in ``layers`` (the step's ``transfer.PagedLayers``), for the GPU
    decoder, or None where it does not apply. Stored checksums are verified here; ``KvzCorruptError`` names a mismatch."""
    index = reader.index
    keys, values, block_size = layers.keys[0], layers.values[0], layers.block_size
    block_ids, first_block = job.block_ids, job.first_block
    if not gpu.decodes(reader.recipe) or gpu.dtype_name(keys.dtype) is None:
        return None
    bytes_ = np.frombuffer(data, np.uint8)
    for row, entry in enumerate(index):
        start = int(entry["offset"])
        if _native.xxh3_64(bytes_[start : start + int(entry["stored_len"])]) != int(entry["stored_xxh3"]):
            raise KvzCorruptError(f"checksum mismatch in chunk {row}")
    tensors = index["tensor"].astype(np.int64)
    layer_pos = np.array([reader.layer_ids.index(layer) for layer, _, _ in reader.tensors], np.int64)[tensors]
    kind = np.array([0 if k == "k" else 1 for _, k, _ in reader.tensors], np.int64)[tensors]
    tokens = reader.num_tokens
    ids = [0] * first_block + list(block_ids)  # the skipped blocks' rows are left out
    rows = []
    for view in (keys, values):
        offsets = row_offsets(view, ids, tokens, first_block * block_size)
        rows.append(np.where(offsets >= 0, offsets // view.element_size() - view.storage_offset(), -1))
    return EntryChunks(
        bytes_, layer_pos, kind, index["offset"].astype(np.int64), index["stored_len"].astype(np.int64),
        index["token_count"].astype(np.int64), index["token_start"].astype(np.int64),
        (index["flags"] & 1).astype(np.int64), np.stack(rows),
    )


def hand_over(decoder: LayerwiseDecode, pending: Sequence[Any], layers: Any,
              fail: Callable[[Any, str, str], None], is_failed: Callable[[Any], bool]) -> None:
    """Give ``decoder`` the opened entries it takes (``Restore``'s pending items: their reader is closed and
    cleared, ``gpu_index`` set) and queue every layer; the others stay for the CPU decode."""
    for p in pending:
        if p.reader is None or is_failed(p):
            continue
        try:
            chunks = gpu_chunks(p.reader, p.data, layers, p.job)
        except KvtoolError as exc:
            fail(p, str(exc), "damaged")
            continue
        if chunks is not None:
            p.gpu_index = decoder.add(chunks)
            p.reader.close()
            p.reader = None
    decoder.start()
