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

The default is ``int:4,k=channel,v=token,group=32``. Bits go where the model
needs them: ``kbits=``/``vbits=`` (1 to 8; 0, the default, means ``BITS``)
give the keys or the values a width of their own, and ``layers=`` gives single
tensors theirs: ``layers=k0:8+k3:6`` stores layer 0's keys in 8 bits and layer
3's in 6 (``kvtool bench accuracy --layers-of`` measures which layers matter).
The recipe, every width included, is in the header of every ``.kvz``, so a file says
how each of its tensors was coded. ``codes=ctx`` (the default is ``packed``) codes the
packed codes with a context model of the previous token (``kvtool.layouts.int_codes``,
which documents that plane); the approximation is the same. For a block ``[heads, tokens, dim]`` the
planes are

``codes``
    ``uint8 [ceil(heads * tokens * dim * W / 8)]``, ``W`` the widest width
    the recipe gives any tensor (so the planes never depend on the tensor):
    the tensor's codes in the block's C order, in its own width, packed most
    significant bit first (``np.packbits``); a narrower tensor leaves the
    plane's tail zero, which the codec after the stage stores in a few
    bytes.
``scales``
    ``float16 [heads, G, 2]``: per group ``(scale, min)``, groups in the C
    order of ``[heads, dim, token groups]`` (channel) or ``[heads, tokens,
    channel groups]`` (token). ``G`` is the larger of the two axes' group
    counts, whichever the kinds use, so the plane's size never depends on the
    kind; unused entries are zero.

``min`` is the group's least value rounded down to fp16, and ``scale`` is
``(max - min) / (2**BITS - 1)`` rounded up, so every code fits and the error
is at most ``scale / 2`` (plus the rounding of ``q * scale + min`` in fp32 and
into the cache's dtype). Values beyond fp16's range (65504) are refused, and so
are groups whose codes would come back as infinity.

The C core (``kvtool._native``, intquant.c) restores blocks; the numpy code
here is the reference it matches bit for bit, and runs where the core is off.
"""

from __future__ import annotations

import copy
import math

import numpy as np

from kvtool import _native
from kvtool._native.int_batch import IntBatchCodec
from kvtool.dtypes import DTYPES, dtype_of
from kvtool.errors import UsageError
from kvtool.layouts import int_codes
from kvtool.layouts.base import PlaneSpec, child_name
from kvtool.layouts.lossy import KindAxes, LossyLayout, choice_param, finite_values, int_param, rounding_bound

AXES = ("channel", "token")
KINDS = ("k", "v")
CODES = ("packed", "ctx")
MAX_GROUP = 1 << 16
FP16_MAX = float(np.finfo(np.float16).max)
#: The cache dtypes the C core takes, by numpy dtype (the rest go to the numpy reference, which refuses them).
NATIVE_DTYPES = {DTYPES[name].numpy: name for name in ("bf16", "fp16", "fp32")}


class IntQuant(KindAxes, LossyLayout):
    layout_id = "int"
    params = ("bits", "k", "v", "group", "kbits", "vbits", "layers", "codes")
    spec_param = "bits"
    param_types = {"bits": int, "group": int, "kbits": int, "vbits": int}  # noqa: RUF012 - a ClassVar, declared in LossyLayout
    axes_phrase = "quantizes keys along {k}s and values along {v}s"

    def __init__(self, bits: int = 4, k: str = "channel", v: str = "token", group: int = 32, kbits: int = 0,
                 vbits: int = 0, layers: str = "", codes: str = "packed"):
        self.bits = int_param(self.layout_id, "bits", bits, 1, 8)
        self.k = choice_param(self.layout_id, "k", k, AXES)
        self.v = choice_param(self.layout_id, "v", v, AXES)
        self.group = int_param(self.layout_id, "group", group, 1, MAX_GROUP)
        self.kbits = int_param(self.layout_id, "kbits", kbits, 0, 8)
        self.vbits = int_param(self.layout_id, "vbits", vbits, 0, 8)
        if not isinstance(layers, str):
            raise UsageError(f"layout {self.layout_id!r}: layers must be a string such as 'k0:8+k3:6', not {layers!r}")
        self.layers = layers
        self.codes = choice_param(self.layout_id, "codes", codes, CODES)
        self._layer_bits = parse_layers(self.layout_id, layers)
        #: Every width a tensor of this recipe may get: the codes plane has room for the widest.
        self.widest = max([self.kind_bits("k"), self.kind_bits("v"), *self._layer_bits.values()])
        self._axis: str | None = None  # set by for_kind
        self._bits: int | None = None  # set by for_kind, where the tensor's layer is known or no layer has a width of its own
        #: plan_plane's answers, shared with the copies for_kind binds (a plan depends on neither kind nor layer)
        self._plans: dict[PlaneSpec, tuple[PlaneSpec, PlaneSpec]] = {}

    def get_config(self) -> dict:
        """Without ``codes`` where it is the default, so recipes from before the option keep their headers."""
        config = super().get_config()
        if self.codes == "packed":
            del config["codes"]
        return config

    def kind_bits(self, kind: str) -> int:
        """The code width of a kind's tensors, before ``layers``' per-layer widths."""
        return (self.kbits if kind == "k" else self.vbits) or self.bits

    def for_kind(self, kind: str, layer: int | None = None) -> "IntQuant":
        if kind not in KINDS:
            raise UsageError(f"layout {self.layout_id!r}: tensor kind must be 'k' or 'v', not {kind!r}")
        bound = copy.copy(self)
        bound._axis = self.k if kind == "k" else self.v
        if layer is not None:
            bound._bits = self._layer_bits.get((kind, layer), self.kind_bits(kind))
        elif not self._layer_bits:
            bound._bits = self.kind_bits(kind)
        return bound

    def batch_kernel(self, dtype: np.dtype) -> IntBatchCodec | None:
        return IntBatchCodec.of(dtype, self.group)

    @property
    def code_bits(self) -> int:
        """The width of this tensor's codes; known once bound to a kind and a layer, or when all tensors share it."""
        if self._bits is not None:
            return self._bits
        if self.kind_bits("k") == self.kind_bits("v") and not self._layer_bits:
            return self.bits
        raise UsageError(
            f"layout {self.spec()!r} gives tensors different code widths: it needs to know which tensor a block is "
            "(a .kvz recipe knows; here bind it with for_kind(kind, layer))"
        )

    def _counts(self, axis: str, tokens: int, dim: int) -> tuple[int, int, int]:
        """``(rows, groups per row, values per row)`` of the axis's grouping of a ``[tokens, dim]`` head."""
        rows, length = (dim, tokens) if axis == "channel" else (tokens, dim)
        return rows, -(-length // self.group), length

    def plan_plane(self, spec: PlaneSpec) -> list[PlaneSpec]:
        plan = self._plans.get(spec)  # a block's plan is asked for several times a block: worked out once
        if plan is None:
            self.check_input(spec)
            heads, tokens, dim = spec.shape
            groups = max(rows * per_row for rows, per_row, _ in (self._counts(a, tokens, dim) for a in {self.k, self.v}))
            packed = -(-heads * tokens * dim * self.widest // 8)
            codes = int_codes.plane_size(heads * tokens * dim, self.widest) if self.codes == "ctx" else packed
            plan = self._plans[spec] = (
                PlaneSpec(child_name(spec.name, "codes"), (codes,), np.dtype(np.uint8)),
                PlaneSpec(child_name(spec.name, "scales"), (heads, groups, 2), np.dtype(np.float16)),
            )
        return list(plan)

    def forward_plane(self, plane: np.ndarray) -> list[np.ndarray]:
        planes = self._native_forward(plane)
        planes = planes if planes is not None else self.reference_forward(plane)
        if self.codes == "ctx":  # the packed codes (the plane's head), coded
            planes[0] = int_codes.encode(planes[0], plane.shape, self.code_bits, planes[0].size)
        return planes

    def _packed(self, planes: list[np.ndarray], spec: PlaneSpec) -> list[np.ndarray]:
        """The planes with the packed codes, as ``codes=packed`` stores them."""
        if self.codes == "packed":
            return planes
        return [int_codes.decode(planes[0], spec.shape, self.code_bits), *planes[1:]]

    def _native_forward(self, plane: np.ndarray) -> list[np.ndarray] | None:
        """The C core's forward, the same bytes as ``reference_forward``; None where it is off or declines
        (values the reference refuses, with its own words)."""
        core = _native.core()
        name = NATIVE_DTYPES.get(np.dtype(plane.dtype))
        if core is None or name is None or plane.ndim != 3:
            return None
        codes_spec, scales_spec = self.plan_plane(PlaneSpec.of(plane))
        codes, scales = np.zeros(codes_spec.shape, np.uint8), np.empty(scales_spec.shape, np.float16)
        used = -(-plane.size * self.code_bits // 8)  # a narrower tensor's codes leave the plane's tail zero
        heads, tokens, dim = plane.shape
        status = core.int_quant(_native.byte_view(np.ascontiguousarray(plane)), codes[:used], scales.view(np.uint16),
                                _native.DTYPE_CODES[name], heads, tokens, dim, self.code_bits, self.axis == "channel",
                                self.group, scales.shape[1])
        return [codes, scales] if status == 0 else None

    def reference_forward(self, plane: np.ndarray) -> list[np.ndarray]:
        """The numpy forward: the definition the C core matches."""
        values = finite_values(self.layout_id, plane)
        _, tokens, dim = values.shape
        groups = self._grouped(values)
        low, scale = self._group_params(groups)
        top = np.float32((1 << self.code_bits) - 1) * scale.astype(np.float32) + low.astype(np.float32)
        with np.errstate(over="ignore"):
            if not np.isfinite(top.astype(plane.dtype)).all():
                raise UsageError(f"layout {self.layout_id!r}: values this close to the limit of {dtype_of(plane.dtype).name} "
                                 "would come back as infinity; use fp8 or mant-round")
        codes = groups - low
        codes /= np.where(scale > 0, scale, 1.0)
        np.clip(np.rint(codes, out=codes), 0, (1 << self.code_bits) - 1, out=codes)
        scales = np.zeros(self.plan_plane(PlaneSpec.of(plane))[1].shape, np.float16)
        used = math.prod(low.shape[1:])
        scales[:, :used, 0] = self._in_plane_order(scale)
        scales[:, :used, 1] = self._in_plane_order(low)
        packed = np.zeros(self.plan_plane(PlaneSpec.of(plane))[0].shape, np.uint8)
        codes_bytes = _pack(self._ungrouped(codes.astype(np.uint8), tokens, dim), self.code_bits)
        packed[: codes_bytes.size] = codes_bytes
        return [packed, scales]

    def inverse_plane(self, planes: list[np.ndarray], spec: PlaneSpec) -> np.ndarray:
        out = np.empty(spec.shape, spec.dtype)
        planes = self._packed(planes, spec)
        return out if self._native_inverse(planes, spec, out) else self.reference_inverse(planes, spec)

    def inverse_plane_into(self, planes: list[np.ndarray], spec: PlaneSpec, out: np.ndarray) -> None:
        planes = self._packed(planes, spec)
        if not self._native_inverse(planes, spec, out):
            np.copyto(out, self.reference_inverse(planes, spec))

    def _native_inverse(self, planes: list[np.ndarray], spec: PlaneSpec, out: np.ndarray) -> bool:
        """The C core's inverse into ``out`` (C-contiguous), the same bits as ``reference_inverse``; False where
        it is off or declines (non-finite scales)."""
        core = _native.core()
        name = NATIVE_DTYPES.get(np.dtype(spec.dtype))
        if core is None or name is None:
            return False
        heads, tokens, dim = spec.shape
        scales = np.ascontiguousarray(planes[1]).view(np.uint16)
        status = core.int_dequant(np.ascontiguousarray(planes[0]), scales, _native.byte_view(out), _native.DTYPE_CODES[name],
                                  heads, tokens, dim, self.code_bits, self.axis == "channel", self.group, scales.shape[1])
        return status == 0

    def reference_inverse(self, planes: list[np.ndarray], spec: PlaneSpec) -> np.ndarray:
        """The numpy inverse: the definition the C core matches."""
        heads, tokens, dim = spec.shape
        codes = _unpack(planes[0], heads * tokens * dim, self.code_bits).reshape(heads, tokens, dim)
        grouped = self._grouped(codes)
        used = math.prod(grouped.shape[1:]) // self.group
        scales = planes[1][:, :used].astype(np.float32)
        values = grouped.astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):  # only damaged scales overflow; checksums catch those first
            values *= self._from_plane_order(scales[..., 0], grouped.shape)
            values += self._from_plane_order(scales[..., 1], grouped.shape)
            return self._ungrouped(values, tokens, dim).astype(spec.dtype)

    def error_bound(self, block: np.ndarray) -> np.ndarray:
        values = block.astype(np.float64)
        _, tokens, dim = values.shape
        groups = self._grouped(values)
        low, scale = self._group_params(groups)
        step = self._ungrouped(np.broadcast_to(scale, groups.shape), tokens, dim)
        floor = self._ungrouped(np.broadcast_to(np.abs(low), groups.shape), tokens, dim)
        magnitude = np.abs(values) + step
        fp32 = rounding_bound(magnitude + floor, DTYPES["fp32"])  # q * scale + min, in fp32
        return 0.5 * step + 2 * fp32 + rounding_bound(magnitude, dtype_of(block.dtype))

    # -- groups: ``[heads, tokens, dim]`` cut along the axis, without moving the data -------------
    @property
    def _group_axis(self) -> int:
        """Where a group's values run in ``_grouped``'s output."""
        return 2 if self.axis == "channel" else 3

    def _group_params(self, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per group the stored ``min`` (rounded down to fp16) and ``scale`` (rounded up), as float64, shaped to broadcast over ``groups``."""
        # + 0.0 turns -0.0 into 0.0: which zero numpy's min and max return varies, the stored scales must not
        least = groups.min(axis=self._group_axis, keepdims=True) + 0.0
        most = groups.max(axis=self._group_axis, keepdims=True) + 0.0
        if groups.size and max(-least.min(), most.max()) > FP16_MAX:
            raise UsageError(f"layout {self.layout_id!r} stores fp16 scales: values beyond +-{FP16_MAX:g} do not fit (use fp8 or mant-round)")
        low = _fp16_toward(least, -np.inf)
        with np.errstate(over="ignore"):
            scale = _fp16_toward((most - low) / ((1 << self.code_bits) - 1), np.inf)
        if not np.isfinite(scale).all():
            raise UsageError(f"layout {self.layout_id!r}: a group spans more than {self.code_bits}-bit codes can step over "
                             f"with an fp16 scale (max - min over {(1 << self.code_bits) - 1} beyond {FP16_MAX:g}); use more bits")
        return low, scale

    def _grouped(self, values: np.ndarray) -> np.ndarray:
        """``[heads, token groups, group, dim]`` (channel) or ``[heads, tokens, channel groups, group]`` (token).

        A view where the group divides the axis; otherwise the last group is
        padded with its own last value.
        """
        heads, tokens, dim = values.shape
        axis = 1 if self.axis == "channel" else 2
        per_row = -(-values.shape[axis] // self.group)
        missing = per_row * self.group - values.shape[axis]
        if missing:
            widths = [(0, 0)] * 3
            widths[axis] = (0, missing)
            values = np.pad(values, widths, mode="edge") if values.size else np.zeros(
                [n + w for n, (_, w) in zip(values.shape, widths)], values.dtype)
        shape = (heads, per_row, self.group, dim) if axis == 1 else (heads, tokens, per_row, self.group)
        return values.reshape(shape)

    def _ungrouped(self, grouped: np.ndarray, tokens: int, dim: int) -> np.ndarray:
        """The inverse of ``_grouped``: a C-contiguous ``[heads, tokens, dim]``."""
        heads, a, b, c = grouped.shape
        if self.axis == "channel":  # [heads, token groups, group, dim]
            return np.ascontiguousarray(grouped.reshape(heads, a * b, c)[:, :tokens])
        return np.ascontiguousarray(grouped.reshape(heads, a, b * c)[:, :, :dim])  # [heads, tokens, channel groups, group]

    def _in_plane_order(self, param: np.ndarray) -> np.ndarray:
        """Per-group parameters as the scales plane orders them: ``[heads, dim, token groups]`` or ``[heads, tokens, channel groups]``, flat per head."""
        if self.axis == "channel":
            param = param[:, :, 0, :].transpose(0, 2, 1)
        return param.reshape(param.shape[0], math.prod(param.shape[1:]))

    def _from_plane_order(self, flat: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The inverse of ``_in_plane_order``, shaped to broadcast over groups of ``shape``."""
        if self.axis == "channel":
            heads, token_groups, _, dim = shape
            return flat.reshape(heads, dim, token_groups).transpose(0, 2, 1)[:, :, None, :]
        heads, tokens, channel_groups, _ = shape
        return flat.reshape(heads, tokens, channel_groups, 1)


def parse_layers(layout_id: str, layers: str) -> dict[tuple[str, int], int]:
    """Per-layer code widths: ``k0:8+v3:6`` gives layer 0's keys 8 bits and layer 3's values 6."""
    widths: dict[tuple[str, int], int] = {}
    for entry in filter(None, layers.split("+")):
        tensor, colon, width = entry.partition(":")
        kind, layer = tensor[:1], tensor[1:]
        if not colon or kind not in KINDS or not layer.isdigit() or not width.isdigit() or not 1 <= int(width) <= 8 \
                or (kind, int(layer)) in widths:
            raise UsageError(f"layout {layout_id!r}: layers= takes entries KIND LAYER:BITS joined by '+' (k0:8+v3:6), "
                             f"each tensor once, 1 to 8 bits; not {entry!r}")
        widths[kind, int(layer)] = int(width)
    return widths


def _fp16_toward(values: np.ndarray, direction: float) -> np.ndarray:
    """``values`` rounded to fp16 toward ``direction`` (-inf: down, inf: up), as float64."""
    rounded = values.astype(np.float16)
    wrong = rounded.astype(np.float64) < values if direction > 0 else rounded.astype(np.float64) > values
    rounded[wrong] = np.nextafter(rounded[wrong], np.float16(direction))
    return rounded.astype(np.float64)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes below ``2**bits`` as a dense bit stream, most significant bit first (as ``np.packbits`` would).

    Codes go in units of ``n`` (the fewest that fill whole bytes: 4 codes in 3
    bytes at 6 bits), each unit one uint64 whose low ``n * bits`` bits are
    written big-endian; the zero codes that fill the last unit are cut off.
    """
    flat = codes.reshape(-1)
    if bits == 8:
        return flat.copy()
    n, width = _unit(bits)
    units = np.zeros((-(-flat.size // n), n), np.uint64)
    units.reshape(-1)[: flat.size] = flat
    words = np.zeros(len(units), np.uint64)
    for i in range(n):  # the first code in the most significant bits
        words |= units[:, i] << np.uint64((n - 1 - i) * bits)
    packed = words.astype(">u8").view(np.uint8).reshape(-1, 8)[:, 8 - width :]
    return packed.reshape(-1)[: -(-flat.size * bits // 8)]


def _unpack(packed: np.ndarray, count: int, bits: int) -> np.ndarray:
    if bits == 8:
        return packed[:count]
    n, width = _unit(bits)
    units = -(-count // n)
    tail = np.zeros(units * width, np.uint8)
    tail[: min(packed.size, tail.size)] = packed[: tail.size]
    window = np.zeros((units, 8), np.uint8)
    window[:, 8 - width :] = tail.reshape(units, width)
    words = window.view(">u8").reshape(-1).astype(np.uint64)
    codes = np.empty((units, n), np.uint8)
    mask = np.uint64((1 << bits) - 1)
    for i in range(n):
        codes[:, i] = (words >> np.uint64((n - 1 - i) * bits)) & mask
    return codes.reshape(-1)[:count]


def _unit(bits: int) -> tuple[int, int]:
    """``(codes, bytes)`` of the smallest run of codes that ends on a byte boundary."""
    n = 8 // math.gcd(8, bits)
    return n, n * bits // 8
