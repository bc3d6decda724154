"""The ``pca`` stage's batch kernel: a run of its blocks restored by the core straight into a destination's rows.

Per block the core reads the plane (its zstd frame already undone and its raw
checksum checked by the pipeline, ``kvtool.kvz.pca_pipeline``) with the coder
of the block's tensor (``kvtool.layouts.pca``: basis, step, tables, a capsule
built once per tensor) and writes each (head, token) row where the destination
says, with the GIL released for the whole run: no block in between, no copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvtool import _native
from kvtool._native.batch import Buffer, raise_for_status
from kvtool._native.core_api import CoderModel, NativeCore
from kvtool.dtypes import dtype_of
from kvtool.errors import UsageError

#: The dtypes the pca stage codes (the core's codes 0..2).
PCA_DTYPES = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class PcaBatchKernel:
    core: NativeCore
    dtype_code: int

    @classmethod
    def of(cls, dtype: np.dtype) -> "PcaBatchKernel | None":
        """The core's restore of pca blocks of ``dtype``, or None where the core is off or the stage takes no such
        dtype."""
        core = _native.core()
        try:
            name = dtype_of(np.dtype(dtype)).name
        except UsageError:
            return None
        if core is None or name not in PCA_DTYPES:
            return None
        return cls(core, _native.DTYPE_CODES[name])

    def decode(self, planes: Sequence[Buffer], models: Sequence[CoderModel], tokens: np.ndarray, rows: np.ndarray,
               starts: np.ndarray, out_index: np.ndarray, targets: Sequence[np.ndarray]) -> None:
        """Restore block i from ``planes[i]`` with ``models[i]``: its row (h, t) to byte ``rows[starts[i] + h *
        tokens[i] + t]`` of ``targets[out_index[i]]`` (flat writable byte arrays), nowhere where that is -1.
        ``ChunkDecodeError`` names the block that failed."""
        status, failed = self.core.pca_decode_run(
            list(planes), list(models), self.dtype_code, _int64(tokens), _int64(rows), _int64(starts), _int64(out_index),
            list(targets),
        )
        raise_for_status(self.core, status, failed)


def _int64(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, dtype="<i8").tobytes()
