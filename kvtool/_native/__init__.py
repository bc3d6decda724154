"""kvtool's native core: the C kernels of the hot path, and how to reach them.

``core()`` is the compiled extension (``kvtool._native._core``, built by ``pip
install`` through setuptools; typed by ``core_api.NativeCore``) or ``None`` where
it was not built or is turned off with ``KVTOOL_NATIVE=0``; kvtool then runs the
numpy reference of the same formats (``kvtool._native.reference``; ctxans's is
``kvtool.modeldict.ctxans_reference``), which writes and reads the same bytes,
slowly, and says so once in a warning. A core built from other sources (another
job layout, other ctxans constants) is refused.

Kernels with variants for SIMD instruction sets (``ISAS``: exphuff's decoder and row
merge, the XXH3 checksum, ctxtans's lanes) write and read the same bytes at every level.
The core picks one level per process, the best the CPU has, held no higher than
``KVTOOL_SIMD`` when the core is loaded; tests step through every level the CPU has.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from typing import TYPE_CHECKING, cast

import numpy as np
import xxhash

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer  # anything with the buffer protocol

    from kvtool._native.core_api import NativeCore

#: One chunk for ``decode_blocks``; the C struct ``job`` in _core.c.
JOB_DTYPE = np.dtype(
    [
        ("offset", "<u8"),
        ("stored_len", "<u8"),
        ("stored_xxh3", "<u8"),
        ("raw_xxh3", "<u8"),
        ("out_index", "<u4"),
        ("flags", "<u4"),
        ("block_tokens", "<u4"),
        ("reserved", "<u4"),
        ("block_start", "<i8"),
    ]
)
#: What ``encode_blocks`` reports per block; the C struct ``block_meta``.
BLOCK_META_DTYPE = np.dtype(
    [("stored_len", "<u8"), ("raw_len", "<u8"), ("stored_xxh3", "<u8"), ("raw_xxh3", "<u8"), ("flags", "<u8")]
)
JOB_STORED_RAW = 1
#: One block of the lossy int stage for ``int_decode_blocks``; the C struct ``int_job`` in intquant_batch.c.
INT_JOB_DTYPE = np.dtype(
    [
        ("codes_xxh3", "<u8"),
        ("scales_xxh3", "<u8"),
        ("row_start", "<i8"),
        ("head_stride", "<i8"),
        ("token_lo", "<u4"),
        ("token_hi", "<u4"),
        ("out_index", "<u4"),
        ("block_tokens", "<u4"),
        ("groups_per_head", "<u4"),
        ("bits", "u1"),
        ("channel_axis", "u1"),
        ("flags", "u1"),
        ("reserved", "u1"),
    ]
)

#: dtype name -> the core's dtype code (enum kvn_dtype in kvn.h).
DTYPE_CODES = {"bf16": 0, "fp16": 1, "fp32": 2, "fp8_e4m3": 3, "fp8_e5m2": 4}

_DISABLED = ("0", "false", "no", "off")
#: The instruction sets of the core's SIMD kernel variants, narrowest first (enum kvn_isa_level in kvn.h).
ISAS = ("scalar", "avx2", "avx512")


@functools.lru_cache(maxsize=1)
def _load() -> tuple[NativeCore | None, str]:
    if os.environ.get("KVTOOL_NATIVE", "").strip().lower() in _DISABLED:
        return None, "turned off by KVTOOL_NATIVE=0"
    try:
        module = importlib.import_module("kvtool._native._core")
    except ImportError as exc:
        return None, f"not built ({exc}); reinstall kvtool with a C compiler present"
    if (module.JOB_SIZE != JOB_DTYPE.itemsize or module.BLOCK_META_SIZE != BLOCK_META_DTYPE.itemsize
            or getattr(module, "INT_JOB_SIZE", None) != INT_JOB_DTYPE.itemsize
            or getattr(module, "CTXANS_CONSTANTS", None) != _ctxans_constants()):
        return None, "built from other sources than this kvtool; reinstall it"
    module.isa(isa_limit())  # one level for every kernel of this process
    return cast("NativeCore", module), ""  # the C says nothing of its types: core_api states them


def _ctxans_constants() -> dict[str, int]:
    """The ctxans format's constants on the Python side, which the core's ``CTXANS_CONSTANTS`` must equal."""
    from kvtool.modeldict.ctxans_reference import NATIVE_CONSTANTS

    return NATIVE_CONSTANTS


def core() -> NativeCore | None:
    """The compiled core, or None (the reason is in ``status()``); warns once when it is missing."""
    module, reason = _load()
    if module is None and not reason.startswith("turned off"):
        _warn_once(reason)
    return module


def status() -> str:
    """How the hot path runs here, in words."""
    module, reason = _load()
    if module is None:
        return f"numpy reference, slow: native core {reason}"
    return f"native (C, {ISAS[module.isa()]} kernels)"


@functools.lru_cache(maxsize=1)
def _warn_once(reason: str) -> None:
    warnings.warn(f"kvtool's native core is {reason}; using the slower numpy reference", RuntimeWarning, stacklevel=3)


def isa_limit() -> int:
    """The best instruction set (an index of ``ISAS``) the core's kernels may use: ``KVTOOL_SIMD``'s, else the widest."""
    name = os.environ.get("KVTOOL_SIMD", "").strip().lower()
    if not name:
        return len(ISAS) - 1
    if name not in ISAS:
        from kvtool.errors import UsageError

        raise UsageError(f"KVTOOL_SIMD must be one of {', '.join(ISAS)}, not {name!r}")
    return ISAS.index(name)


def isa_here() -> str:
    """The instruction set the core's SIMD kernels run here (the CPU's best, within ``KVTOOL_SIMD``), by name."""
    module = core()
    return ISAS[module.isa()] if module is not None else "none (no native core)"


def byte_view(array: np.ndarray) -> np.ndarray:
    """A flat byte view of a C-contiguous array, for the core's buffers (bf16 and fp8 arrays have no buffer format of their own)."""
    return array.reshape(-1).view(np.uint8)


def xxh3_64(data: ReadableBuffer | np.ndarray) -> int:
    """XXH3-64 of a buffer: the native one releases the GIL, so threads hash in parallel."""
    module = core()
    if module is not None:
        return module.xxh3_64(data)
    # numpy arrays export the buffer protocol; numpy's stubs say so only from Python 3.12
    return xxhash.xxh3_64_intdigest(cast("ReadableBuffer", data))
