"""The layout interface: an invertible, bit-exact reordering of a KV tensor.

A layout maps a list of *planes* to a list of planes. The input of a chain is
one plane, a K or V tensor block ``[kv_heads, tokens, head_dim]`` in its float
dtype; a layout may split a plane into several (byte planes, exponent and
mantissa fields) so that each can be compressed on its own. ``plan`` predicts
the output planes' names, shapes and dtypes from the input's alone, which is how
a reader knows every plane's exact size before it decodes any bytes.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

import numpy as np

from kvtool._native.int_batch import IntBatchCodec
from kvtool._native.pca_batch import PcaBatchKernel
from kvtool.dtypes import DTYPES
from kvtool.component import Component
from kvtool.errors import DecodeError, UsageError

#: A stage's native kernel, which its own batch pipeline drives (``kvtool.kvz.reader.pipeline_for``).
StageKernel: TypeAlias = "IntBatchCodec | PcaBatchKernel"
#: The name of a chain's input plane; planes split off it are named by their part alone.
INPUT_NAME = "data"
#: Where the tokens are in a chain's input ``[heads, tokens, dim]``, counted from the end.
TOKEN_AXIS = -2


@dataclass(frozen=True)
class PlaneSpec:
    """Name, shape and dtype of one plane; its bytes are ``nbytes`` long, C order."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @classmethod
    def of(cls, array: np.ndarray, name: str = "data") -> "PlaneSpec":
        return cls(name, tuple(array.shape), array.dtype)


class Layout(Component, abc.ABC):
    """An invertible transform of planes. Subclasses set ``layout_id`` and ``params``.

    A layout with ``lossy`` set is the exception: an opt-in stage whose inverse
    gives back an approximation (``kvtool.layouts.lossy``).
    """

    kind = "layout"
    id_attr = "layout_id"
    layout_id: ClassVar[str]
    #: True for a stage whose ``inverse`` gives back an approximation of its input, not its bits.
    lossy: ClassVar[bool] = False

    @abc.abstractmethod
    def plan(self, inputs: list[PlaneSpec]) -> list[PlaneSpec]:
        """The planes ``forward`` returns for inputs like these."""

    @abc.abstractmethod
    def forward(self, planes: list[np.ndarray]) -> list[np.ndarray]:
        """Reorder; outputs match ``plan`` and need not be copies where a view will do."""

    @abc.abstractmethod
    def inverse(self, planes: list[np.ndarray], inputs: list[PlaneSpec]) -> list[np.ndarray]:
        """Undo ``forward``: given its outputs and the specs of its inputs, return the inputs bit for bit."""

    def inverse_into(self, planes: list[np.ndarray], spec: PlaneSpec, out: np.ndarray) -> None:
        """Undo ``forward`` for one input plane (``spec``) straight into ``out``, a C-contiguous array
        of its shape and dtype: how a reader restores a block into its destination. Layouts that can
        build their result in place override this; the default copies the inverse's result."""
        np.copyto(out, self.inverse(planes, [spec])[0])

    def for_kind(self, kind: str, layer: int | None = None) -> "Layout":
        """This layout as it applies to the keys (``"k"``) or the values (``"v"``) of a cache (of layer ``layer``).

        A container asks before it transforms a tensor; most layouts treat all
        tensors alike and return themselves. The planes ``plan`` predicts never depend on
        the kind, so a reader knows every plane's size before it decodes one.
        """
        return self

    def for_block(self, position: int, end: int) -> "Layout":
        """This layout as it applies to a block whose first token is at ``position`` of its sequence, in a cache
        that ends before position ``end``: what a writer asks before it transforms a block.

        Most layouts treat every block alike and return themselves; a stage may keep some tokens
        exact or turn keys back by their positions (``pca``). Decoding never needs it: a plane
        that depends on where its block lies says so itself.
        """
        return self

    def batch_kernel(self, dtype: np.dtype) -> StageKernel | None:
        """The native kernel that restores runs of blocks of this layout, alone in its recipe, straight into a
        destination's rows from its planes (decoded by codecs that ``plane_batch``), or None: most layouts have none."""
        return None

    def axis_after(self, axis: int) -> int:
        """Where axis ``axis`` (negative, counted from the end) of an input plane lies in the outputs.

        ``parse_layouts`` follows the token axis through a chain with this, so a
        stage that works along the tokens (``xor-delta``) finds them.
        """
        return axis


class PlaneWiseLayout(Layout):
    """A layout that turns each input plane on its own into one or more output planes."""

    @abc.abstractmethod
    def plan_plane(self, spec: PlaneSpec) -> list[PlaneSpec]:
        """The planes one input plane becomes; raises ``UsageError`` for one this layout cannot take."""

    @abc.abstractmethod
    def forward_plane(self, plane: np.ndarray) -> list[np.ndarray]:
        """Split or reorder one plane, already checked by ``plan_plane``."""

    @abc.abstractmethod
    def inverse_plane(self, planes: list[np.ndarray], spec: PlaneSpec) -> np.ndarray:
        """Rebuild one plane from its outputs, already checked against ``plan_plane``."""

    def inverse_plane_into(self, planes: list[np.ndarray], spec: PlaneSpec, out: np.ndarray) -> None:
        """``inverse_plane`` into ``out`` (C-contiguous, ``spec``'s shape and dtype); by default a copy of its result."""
        np.copyto(out, self.inverse_plane(planes, spec))

    def plan(self, inputs: list[PlaneSpec]) -> list[PlaneSpec]:
        return [out for spec in inputs for out in self.plan_plane(spec)]

    def forward(self, planes: list[np.ndarray]) -> list[np.ndarray]:
        out = []
        for plane in planes:
            self.plan_plane(PlaneSpec.of(plane))
            out.extend(self.forward_plane(plane))
        return out

    def inverse(self, planes: list[np.ndarray], inputs: list[PlaneSpec]) -> list[np.ndarray]:
        groups = [self.plan_plane(spec) for spec in inputs]
        check_planes(self.layout_id, planes, [spec for group in groups for spec in group])
        result, start = [], 0
        for spec, group in zip(inputs, groups):
            result.append(self.inverse_plane(planes[start : start + len(group)], spec))
            start += len(group)
        return result

    def inverse_into(self, planes: list[np.ndarray], spec: PlaneSpec, out: np.ndarray) -> None:
        check_planes(self.layout_id, planes, self.plan_plane(spec))
        self.inverse_plane_into(planes, spec, out)


class TokenAxisLayout(PlaneWiseLayout):
    """A plane-wise layout that works along one axis, the tokens, given counted from the end.

    ``parse_layouts`` points it at the token axis wherever earlier stages moved it
    (``channel-major|xor-delta`` works along ``-1``); ``ID:AXIS`` sets it by hand.
    """

    params = ("axis",)
    spec_param = "axis"

    def __init__(self, axis: int = TOKEN_AXIS):
        if isinstance(axis, bool) or not isinstance(axis, int) or axis >= 0:
            raise UsageError(
                f"{self.layout_id} axis must be a negative integer (-2: tokens of [heads, tokens, dim]), not {axis!r}"
            )
        self.axis = axis

    @classmethod
    def spec_value(cls, arg: str) -> int:
        try:
            return int(arg)
        except ValueError:
            raise UsageError(f"{cls.layout_id} axis must be a negative integer such as -2, not {arg!r}") from None


def check_planes(layout_id: str, planes: list[np.ndarray], expected: list[PlaneSpec]) -> None:
    """Raise ``DecodeError`` unless ``planes`` have exactly the expected count, shapes and dtypes."""
    if len(planes) != len(expected):
        raise DecodeError(f"layout {layout_id!r}: expected {len(expected)} planes, got {len(planes)}")
    for plane, spec in zip(planes, expected):
        if tuple(plane.shape) != tuple(spec.shape) or plane.dtype != np.dtype(spec.dtype):
            raise DecodeError(
                f"layout {layout_id!r}: plane {spec.name!r} should be {list(spec.shape)} {dtype_name(spec.dtype)}, "
                f"got {list(plane.shape)} {dtype_name(plane.dtype)}"
            )


def child_name(parent: str, part: str) -> str:
    """The name of the plane ``part`` split off ``parent``: ``hi``, or ``mant.hi`` further down a chain."""
    return part if parent == INPUT_NAME else f"{parent}.{part}"


def dtype_name(dtype: np.dtype) -> str:
    """kvtool's name for a dtype (``bf16``), else numpy's (``uint8``)."""
    dtype = np.dtype(dtype)
    return next((d.name for d in DTYPES.values() if d.numpy == dtype), dtype.name)


def bits_dtype(layout_id: str, dtype: np.dtype) -> np.dtype:
    """The unsigned integer dtype holding ``dtype``'s bit pattern, for any dtype a layout can reorder.

    That is every dtype in ``kvtool.dtypes.DTYPES`` and native-order integers and
    floats of 1, 2, 4 or 8 bytes (the planes earlier stages produce).
    """
    bits = _bits_dtype(np.dtype(dtype))
    if bits is None:
        raise UsageError(
            f"layout {layout_id!r} cannot reorder dtype {dtype_name(dtype)}; "
            f"it takes {', '.join(DTYPES)} and 1-, 2-, 4- or 8-byte integers"
        )
    return bits


@functools.lru_cache(maxsize=64)
def _bits_dtype(dtype: np.dtype) -> np.dtype | None:
    known = any(d.numpy == dtype for d in DTYPES.values())
    plain = dtype.kind in "uif" and dtype.isnative and dtype.itemsize in (1, 2, 4, 8)
    return np.dtype(f"u{dtype.itemsize}") if known or plain else None
