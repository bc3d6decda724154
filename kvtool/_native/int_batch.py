"""The lossy ``int`` stage's restore, many blocks per native call (``int:B,...|zstd:L`` recipes).

A restore of such a recipe used to run per chunk: for each block, its two planes
through zstd, then the stage's inverse into a block, then a copy into the
destination. ``IntBatchCodec`` takes the planes of a whole run of blocks, already
decompressed (zstd releases the GIL), and restores them in one call of the core
(``int_decode_blocks``, GIL released): each plane's raw checksum verified, each
block's values written straight into the destination's rows. It serves recipes
whose only layout is ``int`` and whose every plane is coded with zstd, on bf16,
fp16 and fp32 caches (the ``int`` layout offers it: ``Layout.batch_kernel``); a recipe with any
other layout takes the per-chunk path.
The inverse is intquant.c's, byte for byte the numpy reference's.

``error_stats`` is the core's copy of what a lossy write measures per block (every lossy stage's,
``ErrorTally.block``): the same float64 bits, without numpy's casts of both blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvtool import _native
from kvtool._native.batch import Buffer, raise_for_status
from kvtool._native.core_api import NativeCore
from kvtool.dtypes import DTYPES, dtype_of
from kvtool.errors import UsageError

#: The dtypes the core's inverse writes.
INT_DTYPES = ("bf16", "fp16", "fp32")
#: Job flags: check the codes' or the scales' raw checksum (decompressed planes); rows at strides, not listed.
VERIFY_CODES, VERIFY_SCALES, STRIDED = 1, 2, 4


class Declined(Exception):
    """A block of the batch has non-finite scales, which only the numpy reference restores."""


@dataclass(frozen=True)
class IntBatchCodec:
    core: NativeCore
    dtype_code: int
    group: int

    @classmethod
    def of(cls, dtype: np.dtype, group: int) -> "IntBatchCodec | None":
        """The core's restore of ``int`` blocks of ``dtype`` in groups of ``group``, or None where the core is off or
        does not write the dtype."""
        core = _native.core()
        try:
            name = dtype_of(np.dtype(dtype)).name
        except UsageError:
            return None
        if core is None or name not in INT_DTYPES:
            return None
        return cls(core, _native.DTYPE_CODES[name], group)

    def decode(self, planes: Sequence[Buffer], jobs: np.ndarray, rows: np.ndarray, targets: list[np.ndarray],
               heads: int, dim: int) -> None:
        """Restore job i's block from ``planes[2i]`` (codes) and ``planes[2i + 1]`` (scales): its row (h, t) to byte
        ``rows[row_start + h * block_tokens + t]`` of ``targets[out_index]`` (flat writable byte arrays), or nowhere
        where that offset is negative; with ``STRIDED``, to byte ``row_start + h * head_stride + t * row bytes`` for
        ``token_lo <= t < token_hi``. ``ChunkDecodeError`` names the job that failed; ``Declined`` where a block is
        left to the reference."""
        status, failed = self.core.int_decode_blocks(
            list(planes), jobs.tobytes(), rows.astype("<i8", copy=False).tobytes(), targets, self.dtype_code, heads, dim,
            self.group,
        )
        if status == self.core.STATUS_DECLINED:
            raise Declined(failed)
        raise_for_status(self.core, status, failed)


def int_jobs(count: int) -> np.ndarray:
    """``count`` zeroed job records (INT_JOB_DTYPE) to fill."""
    return np.zeros(count, _native.INT_JOB_DTYPE)


def error_stats(exact: np.ndarray, approx: np.ndarray) -> tuple[float, float, float] | None:
    """``(max |approx - exact|, sum of squared errors, sum of squared values)`` in float64, as numpy computes them
    (the same bits: pairwise sums in numpy's order), from the core; None where it is off or takes not the dtype."""
    core = _native.core()
    code = _stats_codes().get(exact.dtype.name)  # by name: comparing ml_dtypes' dtypes costs more than the sums
    if core is None or code is None or approx.dtype.name != exact.dtype.name or exact.shape != approx.shape:
        return None
    stats = core.error_stats(_bytes(exact), _bytes(approx), code)
    return None if stats is None else (float(stats[0]), float(stats[1]), float(stats[2]))


def _bytes(array: np.ndarray) -> np.ndarray:
    """A C-ordered byte view of ``array``, copied only where it is not contiguous (numpy's own check compares
    ml_dtypes' dtypes, which costs more than the statistics of a small block)."""
    return _native.byte_view(array if array.flags.c_contiguous else np.ascontiguousarray(array))


@functools.lru_cache(maxsize=1)
def _stats_codes() -> dict[str, int]:
    """The core's dtype code of each numpy dtype ``error_stats`` takes, by numpy's name, looked up once."""
    return {DTYPES[name].numpy.name: _native.DTYPE_CODES[name] for name in INT_DTYPES}
