"""How one LMCache memory object becomes a kvtool cache, and how a stored one is written back in place.

LMCache's multi-process server hands its L2 adapters one object per chunk of
``--chunk-size`` tokens. For a model with ordinary attention the object holds
one tensor ``[kv, layers, tokens, hidden]``: on a GPU ``kv`` = 2 (K then V of
every layer, ``hidden`` = KV heads x head dim, LMCache's ``KV_2LTD``); from
vLLM's CPU build ``kv`` = 1 and each token's ``hidden`` holds K and V of every
head together. Either way the object is ``kv x layers`` blocks of
``[tokens, hidden]``, and kvtool stores block ``j`` and block ``j + n/2`` as K
and V of layer ``j`` (for ``kv`` = 2 exactly K and V of each layer), each a
``[1, tokens, hidden]`` view of the object's own bytes: one channel per element
of ``hidden``, the channels kvtool's recipes model, with no copy on the way in.

Any other object (several kernel groups, an odd number of blocks, a dtype kvtool
does not code, LMCache's benchmark payloads, an odd or zero size) is kept as its
bytes: a one-layer cache of 1-byte elements whose first half is K and second
half V; the last byte of an odd-sized object (its ``tail``) goes into the
entry's provenance, which the .kvz header's checksum covers. It round-trips bit
for bit with every lossless recipe; only the ratio is lower.

A load decodes straight into the destination object (``restore_chunk``):
``destination(out)`` gives every (tensor, token) row's byte offset in it, and
``expected()`` what an entry must hold to be written there
(``kvtool.entries``). This module needs numpy only (no torch, no LMCache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from kvtool.cache import KVCache, ModelFacts
from kvtool.destinations import Rows
from kvtool.dtypes import DTYPES, dtype_of
from kvtool.entries import Expected, Miss, Restored, open_entry
from kvtool.errors import UsageError
from kvtool.store import Store

#: The element type an object kept as bytes is coded as (any bit pattern round-trips).
BYTES_DTYPE = "fp8_e4m3"
#: Widest row of an object kept as bytes: fewer, longer rows decode faster.
MAX_BYTES_ROW = 4096


@dataclass(frozen=True)
class ChunkLayout:
    """What an object's bytes hold: ``2 x layers`` blocks of ``[tokens, width]`` elements of ``dtype``; K of layer
    ``j`` is block ``j``, V block ``layers + j``; then ``tail`` bytes (the last byte of an odd-sized object)."""

    kind: str  # "kv" (K and V blocks), "blocks" (blocks paired as K and V) or "bytes"
    dtype: str  # kvtool's dtype name
    layers: int
    tokens: int
    width: int
    tail: int = 0

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], dtypes: Sequence[str], nbytes: int) -> "ChunkLayout":
        """The layout of an object with these kernel-group shapes, dtype names (``torch.bfloat16``) and size."""
        if len(shapes) == 1 and len(dtypes) == 1 and len(shapes[0]) == 4:
            kv, layers, tokens, width = (int(n) for n in shapes[0])
            name = str(dtypes[0]).removeprefix("torch.")
            try:
                dtype = dtype_of(name)
            except UsageError:
                dtype = None
            blocks = kv * layers
            if dtype is not None and blocks % 2 == 0 and min(blocks, tokens, width) > 0 \
                    and blocks * tokens * width * dtype.itemsize == nbytes:
                return cls("kv" if kv == 2 else "blocks", dtype.name, blocks // 2, tokens, width)
        if nbytes < 0:
            raise UsageError(f"an object cannot hold {nbytes} bytes")
        half = nbytes // 2
        width = math.gcd(half, MAX_BYTES_ROW)  # MAX_BYTES_ROW for an empty object: 0 tokens of it
        return cls("bytes", BYTES_DTYPE, 1, half // width, width, nbytes % 2)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def body_bytes(self) -> int:
        """The bytes of the K and V blocks: all but the tail."""
        return 2 * self.layers * self.tokens * self.width * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.body_bytes + self.tail

    def facts(self, model: str) -> ModelFacts:
        return ModelFacts(model_id=model, architecture="lmcache-chunk", num_layers=self.layers, num_kv_heads=1,
                          head_dim=self.width)

    def cache(self, data: np.ndarray, model: str) -> KVCache:
        """The object's bytes (a flat uint8 array) as a cache of views: nothing is copied but the tail."""
        if data.nbytes != self.nbytes:
            raise UsageError(f"object holds {data.nbytes} bytes, its layout {self.nbytes}")
        body = data[:self.body_bytes]
        array = body.view(DTYPES[self.dtype].numpy).reshape(2, self.layers, self.tokens, self.width)
        keys = [array[0, layer][None] for layer in range(self.layers)]
        values = [array[1, layer][None] for layer in range(self.layers)]
        provenance = {"source": "lmcache", "layout": self.kind}
        if self.tail:
            provenance["tail"] = data[self.body_bytes:].tobytes().hex()
        return KVCache(keys, values, self.facts(model), provenance)

    def rows(self) -> np.ndarray:
        """``[2 * layers, 1, tokens]`` byte offsets in the object of each row, K then V of each layer."""
        row = self.width * self.itemsize
        tensor = np.arange(2 * self.layers, dtype=np.int64)
        block = (tensor % 2) * self.layers + tensor // 2  # K of layer l is block l, V is block layers + l
        starts = block * self.tokens * row
        return (starts[:, None, None] + np.arange(self.tokens, dtype=np.int64)[None, None, :] * row).astype(np.int64)

    def destination(self, out: np.ndarray) -> Rows:
        """The object's bytes ``out`` (a flat writable uint8 array) as the rows a restore writes (all but the tail)."""
        return Rows([out], self.rows(), [0] * (2 * self.layers))

    def stored_tail(self, provenance: Mapping[str, Any]) -> bytes | None:
        """The tail an entry's provenance keeps, if it is the one this layout needs (none for an even size)."""
        text = provenance.get("tail", "")
        if not isinstance(text, str) or len(text) != 2 * self.tail:
            return None
        try:
            return bytes.fromhex(text)
        except ValueError:
            return None

    def expected(self) -> Expected:
        """What a stored entry must hold to be written into an object of this layout."""
        return Expected(self.layers, (1, self.tokens, self.width), self.dtype)


def restore_chunk(store: Store, key: str, layout: ChunkLayout, out: np.ndarray, threads: int | None = 1) -> Restored:
    """Restore the entry under ``key`` into the object's bytes ``out`` (a flat writable uint8 array): its blocks
    decoded in place (its layers shared by ``threads``), its tail (if any) copied from the entry's provenance. Any
    failure is a ``Restored`` miss."""
    opened = open_entry(store, key, layout.expected())
    if isinstance(opened, Restored):
        return opened
    with opened:
        tail = layout.stored_tail(opened.reader.provenance)
        if tail is None:
            return Restored(key, Miss.MISMATCH, f"it does not keep the {layout.tail}-byte tail of this object",
                            opened.tier, opened.stored_bytes, fetch_seconds=opened.fetch_seconds)
        restored = opened.restore(layout.destination(out), threads=threads)
    if restored.ok and tail:
        out[layout.body_bytes:] = np.frombuffer(tail, np.uint8)
    return restored
