"""Other tools on the same bytes, measured in the same run: the yardsticks for kvtool's recipes.

Each peer compresses the cache cut into the same blocks as a .kvz (a tensor's
``chunk_tokens`` tokens, C order), block by block on one thread, and must give
the bytes back. ``memcpy`` copies the blocks into a buffer allocated once: the
physical limit of any restore. Blosc2 is in the ``bench`` extra; ZipNN, which
needs torch, has an extra of its own (``zipnn``), so the benchmark's own install
pulls no torch. A peer that is missing, or cannot be imported, is a row naming
what to install, never a failure or a silent gap.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvtool.cache import KVCache

#: A peer: how to build (compress, decompress) for a dtype, or why it cannot run. Both give a buffer
#: (bytes, bytearray or a numpy array, as the tool makes it).
Codec = tuple[Callable[[bytes], Any], Callable[..., Any]]


@dataclass(frozen=True)
class Peer:
    name: str
    module: str | None  # the import it needs, if any
    build: Callable[[str, int], Codec | str]  # (dtype name, itemsize) -> codec, or the reason it does not apply
    install: str = "pip install 'kvtool[bench]'"  # what brings ``module``


def _memcpy(dtype: str, itemsize: int) -> Codec:
    def copy(block):
        out = np.empty(len(block), np.uint8)
        np.copyto(out, np.frombuffer(block, np.uint8))
        return out

    return copy, copy


def _lz4(dtype: str, itemsize: int) -> Codec:
    import lz4.frame

    return lz4.frame.compress, lz4.frame.decompress


def _zstd3(dtype: str, itemsize: int) -> Codec:
    import zstandard

    cctx, dctx = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    return cctx.compress, dctx.decompress


def _blosc2(dtype: str, itemsize: int) -> Codec:
    import blosc2

    def compress(block):
        return blosc2.compress2(block, typesize=itemsize, clevel=1, codec=blosc2.Codec.ZSTD, filters=[blosc2.Filter.SHUFFLE], nthreads=1)

    return compress, lambda data: blosc2.decompress2(data, nthreads=1)


def _zipnn(dtype: str, itemsize: int) -> Codec | str:
    with warnings.catch_warnings():  # torch warns about its own deprecations as zipnn imports it
        warnings.simplefilter("ignore", FutureWarning)
        from zipnn import ZipNN

    formats = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    if dtype not in formats:
        return f"ZipNN has no {dtype} mode"
    codec = ZipNN(input_format="byte", bytearray_dtype=formats[dtype], threads=1)
    # ZipNN rewrites a bf16 input buffer in place: it gets a fresh copy, made before the timer starts.
    return (lambda block: codec.compress(bytearray(block))), codec.decompress


#: ZipNN needs torch; from PyPI a bare torch is the CUDA build (gigabytes), so the CPU build goes first.
ZIPNN_INSTALL = "pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install 'kvtool[zipnn]'"

PEERS = (
    Peer("memcpy", None, _memcpy),
    Peer("lz4 frame", "lz4", _lz4),
    Peer("zstd:3 frame", "zstandard", _zstd3),
    Peer("blosc2 shuffle+zstd:1", "blosc2", _blosc2),
    Peer("ZipNN", "zipnn", _zipnn, install=ZIPNN_INSTALL),
)


def blocks_of(cache: KVCache, chunk_tokens: int) -> list[bytes]:
    """The cache's blocks as a .kvz cuts them, each as C-order bytes."""
    return [
        np.ascontiguousarray(array[:, start : start + chunk_tokens]).tobytes()
        for _, _, array in cache.tensors()
        for start in range(0, array.shape[1], chunk_tokens)
    ]


def build(peer: Peer, cache: KVCache) -> Codec | str:
    """The peer's codec for this cache, or why it cannot run here."""
    if peer.module and importlib.util.find_spec(peer.module) is None:
        return f"{peer.module} is not installed ({peer.install})"
    try:
        return peer.build(cache.dtype.name, cache.dtype.itemsize)
    except ImportError as exc:  # installed, but something it imports is not (zipnn without torch)
        return f"{peer.module} is not installed: it cannot import {exc.name or exc} ({peer.install})"
