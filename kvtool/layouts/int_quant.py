"""``int:BITS``: values as unsigned integer codes with a scale and an offset per group (lossy).

As KIVI quantizes a KV cache: each group of ``group`` values shares an fp16
``scale`` and ``min``; a value ``x`` is stored as the code
``q = round((x - min) / scale)`` in ``BITS`` bits (1 to 8) and comes back as
``q * scale + min``. Where the groups run is the *axis*, chosen per tensor
kind (``k=``, ``v=``):

``channel``
    ``group`` consecutive tokens of one channel (per-channel quantization;
    KIVI's choice for keys, whose channels differ in scale by orders of
    magnitude).
``token``
    ``group`` consecutive channels of one token (per-token quantization;
    KIVI's choice for values). A token's last group may be shorter.

The default is ``int:4,k=channel,v=token,group=32``. For a block ``[heads,
tokens, dim]`` the planes are

``codes``
    ``uint8 [ceil(heads * tokens * dim * BITS / 8)]``: the codes in the
    block's C order, packed most significant bit first (``np.packbits``).
``scales``
    ``float16 [heads, G, 2]``: per group ``(scale, min)``, groups in the C
    order of ``[heads, dim, token groups]`` (channel) or ``[heads, tokens,
    channel groups]`` (token). ``G`` is the larger of the two axes' group
    counts, whichever the kinds use, so the plane's size never depends on the
    kind; unused entries are zero.

``min`` is the group's least value rounded down to fp16, and ``scale`` is
``(max - min) / (2**BITS - 1)`` rounded up, so every code fits and the error
is at most ``scale / 2`` (plus the rounding of ``q * scale + min`` in fp32 and
into the cache's dtype). Values beyond fp16's range (65504) are refused.
"""

from __future__ import annotations

import copy

import numpy as np

from kvtool.cache import DTYPES, dtype_of
from kvtool.errors import UsageError
from kvtool.layouts.base import PlaneSpec, child_name
from kvtool.layouts.lossy import LossyLayout, choice_param, finite_values, int_param, rounding_bound

AXES = ("channel", "token")
KINDS = ("k", "v")
MAX_GROUP = 1 << 16
FP16_MAX = float(np.finfo(np.float16).max)


class IntQuant(LossyLayout):
    layout_id = "int"
    params = ("bits", "k", "v", "group")
    spec_param = "bits"
    param_types = {"bits": int, "group": int}  # noqa: RUF012 - a ClassVar, declared in LossyLayout

    def __init__(self, bits: int = 4, k: str = "channel", v: str = "token", group: int = 32):
        self.bits = int_param(self.layout_id, "bits", bits, 1, 8)
        self.k = choice_param(self.layout_id, "k", k, AXES)
        self.v = choice_param(self.layout_id, "v", v, AXES)
        self.group = int_param(self.layout_id, "group", group, 1, MAX_GROUP)
        self._axis: str | None = None  # set by for_kind

    def for_kind(self, kind: str) -> "IntQuant":
        if kind not in KINDS:
            raise UsageError(f"layout {self.layout_id!r}: tensor kind must be 'k' or 'v', not {kind!r}")
        bound = copy.copy(self)
        bound._axis = self.k if kind == "k" else self.v
        return bound

    @property
    def axis(self) -> str:
        """The axis this layout quantizes along; known once bound to a kind, or when K and V share it."""
        if self._axis is not None:
            return self._axis
        if self.k == self.v:
            return self.k
        raise UsageError(
            f"layout {self.spec()!r} quantizes keys along {self.k}s and values along {self.v}s: "
            "it needs to know which a tensor is (a .kvz recipe knows; here bind it with for_kind('k') or ('v'))"
        )

    def _counts(self, axis: str, tokens: int, dim: int) -> tuple[int, int, int]:
        """``(rows, groups per row, values per row)`` of the axis's grouping of a ``[tokens, dim]`` head."""
        rows, length = (dim, tokens) if axis == "channel" else (tokens, dim)
        return rows, -(-length // self.group), length

    def plan_plane(self, spec: PlaneSpec) -> list[PlaneSpec]:
        self.check_input(spec)
        heads, tokens, dim = spec.shape
        groups = max(rows * per_row for rows, per_row, _ in (self._counts(a, tokens, dim) for a in {self.k, self.v}))
        return [
            PlaneSpec(child_name(spec.name, "codes"), (-(-heads * tokens * dim * self.bits // 8),), np.dtype(np.uint8)),
            PlaneSpec(child_name(spec.name, "scales"), (heads, groups, 2), np.dtype(np.float16)),
        ]

    def forward_plane(self, plane: np.ndarray) -> list[np.ndarray]:
        values = finite_values(self.layout_id, plane)
        heads, tokens, dim = values.shape
        groups = self._grouped(values)  # [heads, rows, groups per row, group]
        low, scale = self._group_params(groups)
        safe = np.where(scale > 0, scale, 1.0)[..., None]
        codes = np.clip(np.rint((groups - low[..., None]) / safe), 0, (1 << self.bits) - 1).astype(np.uint8)
        scales = np.zeros(self.plan_plane(PlaneSpec.of(plane))[1].shape, np.float16)
        used = low.shape[1] * low.shape[2]
        scales[:, :used, 0] = scale.reshape(heads, used)
        scales[:, :used, 1] = low.reshape(heads, used)
        return [_pack(self._ungrouped(codes, tokens, dim), self.bits), scales]

    def inverse_plane(self, planes: list[np.ndarray], spec: PlaneSpec) -> np.ndarray:
        heads, tokens, dim = spec.shape
        codes = _unpack(planes[0], heads * tokens * dim, self.bits).reshape(heads, tokens, dim)
        grouped = self._grouped(codes)
        used = grouped.shape[1] * grouped.shape[2]
        scales = planes[1][:, :used].astype(np.float32)
        scale = scales[..., 0].reshape(grouped.shape[:3])[..., None]
        low = scales[..., 1].reshape(grouped.shape[:3])[..., None]
        with np.errstate(over="ignore", invalid="ignore"):  # only damaged scales overflow; checksums catch those first
            values = grouped.astype(np.float32) * scale + low
        return self._ungrouped(values, tokens, dim).astype(spec.dtype)

    def error_bound(self, block: np.ndarray) -> np.ndarray:
        values = block.astype(np.float64)
        heads, tokens, dim = values.shape
        low, scale = self._group_params(self._grouped(values))
        shape = (heads,) + low.shape[1:] + (self.group,)
        step = self._ungrouped(np.broadcast_to(scale[..., None], shape), tokens, dim)
        floor = self._ungrouped(np.broadcast_to(np.abs(low)[..., None], shape), tokens, dim)
        magnitude = np.abs(values) + step
        fp32 = rounding_bound(magnitude + floor, DTYPES["fp32"])  # q * scale + min, in fp32
        return 0.5 * step + 2 * fp32 + rounding_bound(magnitude, dtype_of(block.dtype))

    def _group_params(self, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per group the stored ``min`` (rounded down to fp16) and ``scale`` (rounded up), as float64."""
        least, most = groups.min(axis=-1), groups.max(axis=-1)
        if groups.size and max(-least.min(), most.max()) > FP16_MAX:
            raise UsageError(f"layout {self.layout_id!r} stores fp16 scales: values beyond +-{FP16_MAX:g} do not fit (use fp8 or mant-round)")
        low = _fp16_toward(least, -np.inf)
        scale = _fp16_toward((most - low) / ((1 << self.bits) - 1), np.inf)
        return low, scale

    def _grouped(self, values: np.ndarray) -> np.ndarray:
        """``[heads, tokens, dim]`` as ``[heads, rows, groups per row, group]``, the last group padded with its own last value."""
        heads, tokens, dim = values.shape
        rows, per_row, length = self._counts(self.axis, tokens, dim)
        lined = values.transpose(0, 2, 1) if self.axis == "channel" else values
        if length == 0 or rows == 0:
            return np.zeros((heads, rows, per_row, self.group), values.dtype)
        padded = np.pad(lined, [(0, 0), (0, 0), (0, per_row * self.group - length)], mode="edge")
        return padded.reshape(heads, rows, per_row, self.group)

    def _ungrouped(self, grouped: np.ndarray, tokens: int, dim: int) -> np.ndarray:
        """The inverse of ``_grouped``: a C-contiguous ``[heads, tokens, dim]``."""
        heads, rows, per_row, group = grouped.shape
        lined = grouped.reshape(heads, rows, per_row * group)[:, :, : (tokens if self.axis == "channel" else dim)]
        return np.ascontiguousarray(lined.transpose(0, 2, 1) if self.axis == "channel" else lined)


def _fp16_toward(values: np.ndarray, direction: float) -> np.ndarray:
    """``values`` rounded to fp16 toward ``direction`` (-inf: down, inf: up), as float64."""
    rounded = values.astype(np.float16)
    wrong = rounded.astype(np.float64) < values if direction > 0 else rounded.astype(np.float64) > values
    rounded[wrong] = np.nextafter(rounded[wrong], np.float16(direction))
    return rounded.astype(np.float64)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes below ``2**bits`` as a dense bit stream, most significant bit first."""
    flat = codes.reshape(-1)
    if bits == 8:
        return flat.copy()
    if 8 % bits == 0:  # whole codes per byte: shift them into place
        per_byte = 8 // bits
        padded = np.zeros(-(-flat.size // per_byte) * per_byte, np.uint8)
        padded[: flat.size] = flat
        lanes = padded.reshape(-1, per_byte) << _shifts(bits)
        return np.bitwise_or.reduce(lanes, axis=1) if per_byte > 1 else lanes.reshape(-1)
    return np.packbits(np.unpackbits(flat[:, None], axis=1)[:, 8 - bits :])


def _unpack(packed: np.ndarray, count: int, bits: int) -> np.ndarray:
    if bits == 8:
        return packed
    if 8 % bits == 0:
        lanes = (packed[:, None] >> _shifts(bits)) & np.uint8((1 << bits) - 1)
        return lanes.reshape(-1)[:count]
    padded = np.zeros((count, 8), np.uint8)
    padded[:, 8 - bits :] = np.unpackbits(packed, count=count * bits).reshape(count, bits)
    return np.packbits(padded, axis=1).reshape(-1)


def _shifts(bits: int) -> np.ndarray:
    """Where each of a byte's codes sits, the first in the most significant bits."""
    return np.arange(8 - bits, -1, -bits, dtype=np.uint8)
