"""``outliers:F``: the values at the ends of each row kept apart, exact, so a lossy stage after it quantizes a tight range.

Lossless on its own; it is meant to go before ``int`` (``outliers:0.01|int:3,group=128|zstd:3``),
as KVQuant's dense-and-sparse quantization keeps about 1% of a KV cache in 16 bits and
quantizes the rest over a range without them. A block ``[heads, tokens, dim]`` is cut in
*rows* along an axis chosen per tensor kind (``k=``, ``v=``, as ``int`` groups them):

``channel``
    one channel of one head over the block's tokens (keys: ``int`` groups keys so);
``token``
    one token of one head over its channels (values);
``none``
    no outliers for that kind.

Of each row of ``L`` values, ``c = min(ceil(F * L), (L - 1) // 2)`` are outliers: the
``i`` least and the ``c - i`` greatest, in the total order of the values' bit patterns
(``-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN``, ties by position), with ``i`` the
first of ``0..c`` that leaves the kept values the narrowest range (``max - min`` in
float64; a NaN range counts as infinite). In the first plane each outlier becomes the
kept minimum (the ``i`` least) or the kept maximum (the others), bit for bit, so the
values a lossy stage sees span the kept range only. The planes of an input plane ``p``:

``p``
    the block, its shape and dtype, the outliers replaced;
``p.outlier.pos``
    ``uint8 [N]`` where the block has at most 256 tokens and channels, else ``uint16``
    (``uint32`` beyond 65536):
    each row's outlier positions along the row, ascending, rows in C order of
    ``[heads, dim]`` (channel) or ``[heads, tokens]`` (token), ``c`` per row;
``p.outlier.val``
    the outliers' bit patterns (unsigned integers of the dtype's width), in the same order.

``N`` is the larger count of the two kinds' axes, so the planes never depend on the
kind; a kind with fewer leaves the tail zero, which the reader checks, with every row's
positions strictly ascending and inside the row. bf16, fp16 and fp32 blocks only.

The C core (``kvtool._native``, outliers.c) does both ways; the numpy code here is the
reference it matches bit for bit, and runs where the core is off.
"""

from __future__ import annotations

import copy
import math

import numpy as np

from kvtool import _native
from kvtool.dtypes import DTYPES, dtype_of
from kvtool.errors import DecodeError, UsageError
from kvtool.layouts.base import PlaneSpec, child_name, dtype_name
from kvtool.layouts.lossy import LOSSY_INPUTS, KindAxes, SideChannel, choice_param

AXES = ("channel", "token", "none")
KINDS = ("k", "v")
#: The largest fraction a row may give up: at most half its values, and never all.
MAX_FRACTION = 0.5


class Outliers(KindAxes, SideChannel):
    layout_id = "outliers"
    params = ("fraction", "k", "v")
    spec_param = "fraction"
    param_types = {"fraction": float}  # noqa: RUF012 - a ClassVar, declared in KeywordSpec
    axes_phrase = "cuts keys in {k} rows and values in {v} rows"

    def __init__(self, fraction: float = 0.01, k: str = "channel", v: str = "token"):
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= MAX_FRACTION:
            raise UsageError(f"layout {self.layout_id!r}: fraction must be a number in 0..{MAX_FRACTION}, not {fraction!r}")
        self.fraction = float(fraction)
        self.k = choice_param(self.layout_id, "k", k, AXES)
        self.v = choice_param(self.layout_id, "v", v, AXES)
        self._axis: str | None = None  # set by for_kind

    def for_kind(self, kind: str, layer: int | None = None) -> "Outliers":
        if kind not in KINDS:
            raise UsageError(f"layout {self.layout_id!r}: tensor kind must be 'k' or 'v', not {kind!r}")
        bound = copy.copy(self)
        bound._axis = self.k if kind == "k" else self.v
        return bound

    def counts(self, axis: str, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """``(rows, row length, outliers per row)`` of a ``[heads, tokens, dim]`` block cut along ``axis``."""
        heads, tokens, dim = shape
        if axis == "none":
            return 0, 0, 0
        rows, length = (heads * dim, tokens) if axis == "channel" else (heads * tokens, dim)
        per_row = min(math.ceil(round(self.fraction * length, 9)), (length - 1) // 2) if length else 0
        return rows, length, per_row

    def plan_plane(self, spec: PlaneSpec) -> list[PlaneSpec]:
        if np.dtype(spec.dtype) not in [DTYPES[name].numpy for name in LOSSY_INPUTS]:
            raise UsageError(f"layout {self.layout_id!r} takes {', '.join(LOSSY_INPUTS)} values; plane {spec.name!r} is "
                             f"{dtype_name(spec.dtype)}")
        if len(spec.shape) != 3:
            raise UsageError(f"layout {self.layout_id!r} takes [heads, tokens, dim] blocks, not shape {list(spec.shape)}")
        entries = max(rows * per_row for rows, _, per_row in (self.counts(a, spec.shape) for a in {self.k, self.v}))
        longest = max(spec.shape[1:])  # the longest a row may be, whichever the axis
        positions = np.uint8 if longest <= 1 << 8 else np.uint16 if longest <= 1 << 16 else np.uint32
        return [
            PlaneSpec(spec.name, tuple(spec.shape), np.dtype(spec.dtype)),
            PlaneSpec(child_name(spec.name, "outlier.pos"), (entries,), np.dtype(positions)),
            PlaneSpec(child_name(spec.name, "outlier.val"), (entries,), np.dtype(f"u{np.dtype(spec.dtype).itemsize}")),
        ]

    # -- rows: the block's bits as [rows, length] -------------------------------------------------
    def _rows(self, bits: np.ndarray) -> np.ndarray:
        """A copy of ``bits`` as rows, free to write."""
        heads, tokens, dim = bits.shape
        if self.axis == "channel":
            return np.ascontiguousarray(bits.transpose(0, 2, 1)).reshape(heads * dim, tokens)
        return bits.reshape(heads * tokens, dim).copy()

    def _unrows(self, rows: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        heads, tokens, dim = shape
        if self.axis == "channel":
            return np.ascontiguousarray(rows.reshape(heads, dim, tokens).transpose(0, 2, 1))
        return rows.reshape(shape)

    def _select(self, plane: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(rows, positions, fill)``: the block's bits as rows, each row's outlier positions (ascending) and the
        bits each takes in the first plane (the kept minimum for one of the least, else the kept maximum)."""
        itemsize = plane.dtype.itemsize
        rows = self._rows(np.ascontiguousarray(plane).view(f"u{itemsize}"))
        _, length, per_row = self.counts(self.axis, plane.shape)
        if not rows.size or not per_row:
            empty = np.zeros((rows.shape[0], 0), np.int64)
            return rows, empty, empty.astype(rows.dtype)
        sign = np.array(1 << (8 * itemsize - 1), rows.dtype)
        order_key = np.where(rows & sign, ~rows, rows | sign)  # the bit patterns' total order as unsigned integers
        order = np.argsort(order_key, axis=1, kind="stable")
        with np.errstate(invalid="ignore"):  # a NaN's cast and an infinity's difference warn; they rank last
            values = rows.view(plane.dtype).astype(np.float64)
            least = np.take_along_axis(values, order[:, : per_row + 1], axis=1)
            most = np.take_along_axis(values, order[:, length - 1 - per_row :], axis=1)
            span = most - least  # for i least taken, the kept range is least[i] .. most[i]
        span[np.isnan(span)] = np.inf
        taken_low = np.argmin(span, axis=1)[:, None]
        j = np.arange(per_row)[None, :]
        ranks = np.where(j < taken_low, j, length - per_row + j)
        positions = np.take_along_axis(order, ranks, axis=1)
        low = j < taken_low
        by_position = np.argsort(positions, axis=1)
        positions = np.take_along_axis(positions, by_position, axis=1)
        low = np.take_along_axis(low, by_position, axis=1)
        kept_min = np.take_along_axis(rows, np.take_along_axis(order, taken_low, axis=1), axis=1)
        kept_max = np.take_along_axis(rows, np.take_along_axis(order, length - 1 - per_row + taken_low, axis=1), axis=1)
        return rows, positions, np.where(low, kept_min, kept_max)

    # -- forward and inverse: the C core where it runs, the numpy reference it matches otherwise ------
    def _native_args(self, spec: PlaneSpec) -> tuple | None:
        """The core and the block's geometry for its calls, or None where the core is off or has no rows to cut."""
        core = _native.core()
        if core is None or self.axis == "none":
            return None
        return core, _native.DTYPE_CODES[dtype_of(spec.dtype).name], *spec.shape, self.axis == "channel", \
            self.counts(self.axis, spec.shape)[2]

    def forward_plane(self, plane: np.ndarray) -> list[np.ndarray]:
        spec = PlaneSpec.of(plane)
        native = self._native_args(spec)
        if native is None:
            return self.reference_forward(plane)
        core, *geometry = native
        _, pos_spec, val_spec = self.plan_plane(spec)
        dense, pos, val = np.empty(spec.shape, spec.dtype), np.zeros(pos_spec.shape, pos_spec.dtype), np.zeros(val_spec.shape, val_spec.dtype)
        status = core.outliers_split(_native.byte_view(np.ascontiguousarray(plane)), _native.byte_view(dense), pos.view(np.uint8),
                                     val.view(np.uint8), *geometry)
        return [dense, pos, val] if status == 0 else self.reference_forward(plane)

    def reference_forward(self, plane: np.ndarray) -> list[np.ndarray]:
        """The numpy forward: the definition the C core matches."""
        specs = self.plan_plane(PlaneSpec.of(plane))
        rows, positions, fill = self._select(plane)
        pos = np.zeros(specs[1].shape, specs[1].dtype)
        val = np.zeros(specs[2].shape, specs[2].dtype)
        if positions.size:
            pos[: positions.size] = positions.reshape(-1)
            val[: positions.size] = np.take_along_axis(rows, positions, axis=1).reshape(-1)
            np.put_along_axis(rows, positions, fill, axis=1)  # rows is a copy of the block's bits
        return [self._unrows(rows, plane.shape).view(plane.dtype), pos, val]

    def split(self, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        dense, pos, _ = self.forward_plane(block)
        rows, length, per_row = self.counts(self.axis, block.shape)
        if not rows * per_row:
            return dense, np.zeros(block.shape, bool)
        mask = np.zeros((rows, length), bool)
        np.put_along_axis(mask, pos[: rows * per_row].astype(np.int64).reshape(rows, per_row), True, axis=1)
        return dense, self._unrows(mask, block.shape)

    def inverse_plane(self, planes: list[np.ndarray], spec: PlaneSpec) -> np.ndarray:
        out = np.empty(spec.shape, spec.dtype)
        self.inverse_plane_into(planes, spec, out)
        return out

    def inverse_plane_into(self, planes: list[np.ndarray], spec: PlaneSpec, out: np.ndarray) -> None:
        native = self._native_args(spec)
        if native is not None:
            core, *geometry = native
            dense, pos, val = (np.ascontiguousarray(p) for p in planes)
            if core.outliers_merge(_native.byte_view(dense), pos.view(np.uint8), val.view(np.uint8), _native.byte_view(out),
                                   *geometry) == 0:
                return
        self.reference_inverse_into(planes, spec, out)  # also where the core declines: the reference says what is wrong

    def reference_inverse_into(self, planes: list[np.ndarray], spec: PlaneSpec, out: np.ndarray) -> None:
        """The numpy inverse into ``out``: the definition the C core matches."""
        dense, pos, val = planes
        rows_count, length, per_row = self.counts(self.axis, spec.shape)
        used = rows_count * per_row
        if pos[used:].any() or val[used:].any():
            raise DecodeError(f"layout {self.layout_id!r}: {pos.size - used} unused outlier entries are not zero")
        positions = pos[:used].astype(np.int64).reshape(rows_count, per_row)
        if positions.size and ((positions >= length).any() or (np.diff(positions, axis=1) <= 0).any()):
            raise DecodeError(f"layout {self.layout_id!r}: outlier positions must ascend within rows of {length} values")
        bits = f"u{np.dtype(spec.dtype).itemsize}"
        if not positions.size:
            np.copyto(out, dense)
            return
        rows = self._rows(np.ascontiguousarray(dense).view(bits))
        np.put_along_axis(rows, positions, val[:used].reshape(rows_count, per_row), axis=1)
        np.copyto(out.view(bits), self._unrows(rows, spec.shape))
