"""The compiled core as Python's type checker sees it: ``kvtool._native._core`` is C and says nothing of its types.

``kvtool._native.core()`` hands out the extension as a ``NativeCore``, so every call into C is checked
against what its binding reads: the arguments in the order and of the kinds its ``PyArg_ParseTuple``
format takes them, the results as the C builds them. In the formats, ``y*`` is a buffer the core reads
(``In``), ``w*`` one it writes (``Out``: writable and C-contiguous), ``i``/``n``/``I`` an int, ``p`` a
truth value, ``O!`` with ``PyList_Type`` a list. A status is 0 (done) or one of the ``STATUS_*`` codes.
``tests/test_native.py`` checks that this class names exactly what the extension exports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, Sequence, Union

import numpy as np

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

# numpy arrays export the buffer protocol; numpy's stubs say so only from Python 3.12, hence the arrays by name.
In = Union["ReadableBuffer", np.ndarray]
Out = Union["WriteableBuffer", np.ndarray]
#: A dictionary's coder tables in the core (a PyCapsule): only handed back to the core, which checks its name.
CoderModel = object


class NativeCore(Protocol):
    """``kvtool._native._core``: the functions of its method table and the constants its module init adds."""

    JOB_SIZE: int  # sizeof(job): JOB_DTYPE's itemsize
    BLOCK_META_SIZE: int  # sizeof(block_meta): BLOCK_META_DTYPE's itemsize
    INT_JOB_SIZE: int  # sizeof(int_job): INT_JOB_DTYPE's itemsize
    STATUS_CORRUPT: int
    STATUS_CHECKSUM: int
    STATUS_ARG: int
    STATUS_DECLINED: int  # int_decode_blocks: a block only the numpy reference restores
    CTXANS_CONSTANTS: dict[str, int]  # the ctxans format's constants, as the core was built with them

    def xxh3_64(self, data: In, piece: int = 0, /) -> int: ...  # piece > 0: hashed in pieces of that size
    def isa(self, cap: int = -1, /) -> int: ...  # the SIMD level every kernel uses (of ISAS), capped first if given

    # -- one chunk of a [heads, tokens, dim] block; ``dtype`` is a DTYPE_CODES value ---------------------
    def exphuff_encode(self, block: In, dtype: int, heads: int, tokens: int, dim: int, lane: int = 0, /) -> bytes: ...
    def exphuff_decode(self, chunk: In, out: Out, dtype: int, heads: int, tokens: int, dim: int, /) -> int: ...
    def ctxans_model(self, freq: In, cum: In, cost: In, class_cost: In, context_of: In, start_context: int,
                     classes: int, contexts: int, tag: In, /) -> CoderModel: ...
    def ctxans_encode(self, block: In, model: CoderModel, dtype: int, heads: int, tokens: int, dim: int, /) -> bytes: ...
    def ctxans_decode(self, chunk: In, out: Out, model: CoderModel, dtype: int, heads: int, tokens: int, dim: int,
                      /) -> int: ...
    def ctxtans_model(self, g: In, start: In, symbol: In, nbits: In, base: In, cost: In, class_cost: In, context_of: In,
                      start_context: int, classes: int, contexts: int, tag: In, /) -> CoderModel: ...
    def ctxtans_encode(self, block: In, model: CoderModel, dtype: int, heads: int, tokens: int, dim: int, /) -> bytes: ...
    def ctxtans_decode(self, chunk: In, out: Out, model: CoderModel, dtype: int, heads: int, tokens: int, dim: int,
                       /) -> int: ...

    # -- many chunks per call (kvtool._native.batch): JOB_DTYPE records; (status, failed job or -1) --------
    def encode_blocks(self, tensor: In, dtype: int, heads: int, tokens: int, dim: int, chunk_tokens: int, coded: bool,
                      model: Optional[CoderModel] = None, lane: int = 0, /) -> tuple[bytes, bytes]: ...
    def decode_blocks(self, src: In, jobs: In, out: Out, dtype: int, heads: int, tokens: int, dim: int, verify: bool,
                      model: Optional[CoderModel] = None, /) -> tuple[int, int]: ...
    def decode_rows(self, src: In, jobs: In, row_starts: In, rows: In, targets: list[np.ndarray], dtype: int, heads: int,
                    dim: int, verify: bool, model: Optional[CoderModel] = None, /) -> tuple[int, int]: ...

    # -- the lossy stages: int (kvtool.layouts.int_quant, int_codes) and outliers -------------------------
    def int_quant(self, block: In, codes: Out, scales: Out, dtype: int, heads: int, tokens: int, dim: int, bits: int,
                  channel_axis: bool, group: int, groups_per_head: int, /) -> int: ...
    def int_dequant(self, codes: In, scales: In, out: Out, dtype: int, heads: int, tokens: int, dim: int, bits: int,
                    channel_axis: bool, group: int, groups_per_head: int, /) -> int: ...
    def int_decode_blocks(self, planes: list[In], jobs: In, rows: In, targets: list[np.ndarray], dtype: int, heads: int,
                          dim: int, group: int, /) -> tuple[int, int]: ...
    def int_codes_encode(self, packed: In, plane: Out, heads: int, tokens: int, dim: int, bits: int, /) -> int: ...
    def int_codes_decode(self, plane: In, packed: Out, heads: int, tokens: int, dim: int, bits: int, /) -> int: ...
    def outliers_split(self, block: In, dense: Out, pos: Out, val: Out, dtype: int, heads: int, tokens: int, dim: int,
                       channel_axis: bool, per_row: int, /) -> int: ...
    def outliers_merge(self, dense: In, pos: In, val: In, out: Out, dtype: int, heads: int, tokens: int, dim: int,
                       channel_axis: bool, per_row: int, /) -> int: ...
    def error_stats(self, exact: In, approx: In, dtype: int, /) -> Optional[tuple[float, float, float]]: ...

    # -- the lossy pca stage (kvtool.layouts.pca): one tensor's coder, one block's plane -------------------
    def pca_model(self, mean: In, basis: In, freqs: In, freq: In, table_costs: In, class_costs: In, heads: int, dim: int,
                  components: int, classes: int, step: float, tag: In, /) -> CoderModel: ...
    def pca_encode(self, block: In, plane: Out, model: CoderModel, dtype: int, tokens: int, position: int, exact: In,
                   /) -> int: ...
    def pca_decode(self, plane: In, out: Out, model: CoderModel, dtype: int, tokens: int, /) -> int: ...
    def pca_decode_run(self, planes: Sequence[In], models: Sequence[CoderModel], dtype: int, tokens: In, rows: In,
                       starts: In, out_index: In, targets: Sequence[Out], /) -> tuple[int, int]: ...
