"""Lossy stages: opt-in layouts whose inverse gives back an approximation, within a stated bound.

A lossy stage sits at the head of a recipe's layout chain (or just after a side
channel, ``SideChannel``, which keeps some values exact apart and leaves the
rest in place), where the tensor is still a float block ``[heads, tokens, dim]``
(bf16, fp16 or fp32), and maps it
to planes that hold less: fewer mantissa bits (``mant-round``), fp8 with
scales (``fp8``), or integer codes with scales (``int``). What follows it is
lossless as ever, so the container's checksums cover the planes the stage
produced: ``verify`` proves the stored approximation intact, never the
original. Nothing lossy is a default; a recipe with such a stage says so in
the header of every ``.kvz`` it writes, with the error it measured.

Every lossy stage states, for each input value, a bound on the error of its
round trip (``error_bound``); ``kvtool.testing.lossy.LossyLayoutTests`` checks
it on real caches. A stage refuses non-finite values: there is no
approximation of a NaN worth storing.

Specs take the stage's main parameter first and the others by name, all in
one stage: ``int:4,k=channel,v=token,group=32``.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, cast

import numpy as np

from kvtool._native.int_batch import error_stats
from kvtool.dtypes import DTYPES, DType, dtype_of
from kvtool.errors import UsageError
from kvtool.layouts.base import PlaneSpec, PlaneWiseLayout, check_planes, dtype_name

if TYPE_CHECKING:
    from typing_extensions import Self

    from kvtool.layouts.chain import LayoutChain

#: The dtypes a lossy stage takes: floats wide enough to be worth shrinking.
LOSSY_INPUTS = ("bf16", "fp16", "fp32")


class KeywordSpec:
    """Specs with the main parameter first and the others as ``NAME=VALUE``: ``int:4,group=64``.

    Mixed into a layout (a ``Component``) whose ``param_types`` say how each parameter's text
    becomes its value (``str`` where not named).
    """

    layout_id: ClassVar[str]
    params: ClassVar[tuple[str, ...]]
    spec_param: ClassVar[str | None]
    param_types: ClassVar[dict[str, Callable[[str], Any]]] = {}

    @classmethod
    def from_spec_arg(cls, arg: str) -> Self:
        kwargs: dict[str, Any] = {}
        for position, part in enumerate(p.strip() for p in arg.split(",")):
            name, eq, text = (s.strip() for s in part.partition("="))
            if not eq:
                if position or cls.spec_param is None:
                    raise UsageError(f"layout {cls.layout_id!r}: write parameters as NAME=VALUE, not {part!r}")
                name, text = cls.spec_param, part
            if name not in cls.params or name in kwargs:
                raise UsageError(f"layout {cls.layout_id!r}: unknown or repeated parameter {name!r} (it takes {', '.join(cls.params)})")
            try:
                kwargs[name] = cls.param_types.get(name, str)(text)
            except ValueError:
                raise UsageError(f"layout {cls.layout_id!r}: bad value {text!r} for {name}") from None
        return cls(**kwargs)

    def spec(self) -> str:
        """``ID:MAIN`` and every other parameter that differs from its default."""
        default = type(self)()
        parts = [str(getattr(self, self.spec_param))] if self.spec_param else []
        parts += [
            f"{name}={getattr(self, name)}" for name in self.params
            if name != self.spec_param and getattr(self, name) != getattr(default, name)
        ]
        return f"{self.layout_id}:{','.join(parts)}" if parts else self.layout_id


class KindAxes(KeywordSpec):
    """A stage that takes keys and values along axes of their own (``k``, ``v``): ``axis`` is known once
    ``for_kind`` has bound the stage to a kind (setting ``_axis``), or when both kinds share one."""

    k: str
    v: str
    _axis: str | None
    #: What the stage does along the two axes, for the error that asks for a binding.
    axes_phrase: ClassVar[str]

    @property
    def axis(self) -> str:
        """The axis of the kind this stage is bound to."""
        if self._axis is not None:
            return self._axis
        if self.k == self.v:
            return self.k
        raise UsageError(
            f"layout {self.spec()!r} {self.axes_phrase.format(k=self.k, v=self.v)}: it needs to know which a tensor "
            "is (a .kvz recipe knows; here bind it with for_kind('k') or ('v'))"
        )


class SideChannel(PlaneWiseLayout):
    """A lossless stage that may go before a lossy one: it keeps some values apart, exact, in planes after the first.

    The lossy stage after it approximates the first plane only (the block with those
    values replaced) and passes the other planes through (``outliers``).
    """

    @abc.abstractmethod
    def split(self, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(dense, exact)``: the first plane ``forward`` makes of ``block``, and a mask of the values kept apart."""


class LossyLayout(KeywordSpec, PlaneWiseLayout):
    """A plane-wise stage whose inverse approximates its input; subclasses give the bound.

    It approximates its first input plane; planes after it, a side channel's (``SideChannel``),
    pass through unchanged.
    """

    lossy = True

    @abc.abstractmethod
    def error_bound(self, block: np.ndarray) -> np.ndarray:
        """For each value of ``block`` (float64, its shape), a bound on ``|value - inverse(forward(block))|``."""

    # -- the first plane approximated, a side channel's planes passed through -------------------
    def plan(self, inputs: list[PlaneSpec]) -> list[PlaneSpec]:
        return [*self.plan_plane(inputs[0]), *inputs[1:]] if inputs else []

    def forward(self, planes: list[np.ndarray]) -> list[np.ndarray]:
        if not planes:
            return []
        self.plan_plane(PlaneSpec.of(planes[0]))
        return [*self.forward_plane(planes[0]), *planes[1:]]

    def inverse(self, planes: list[np.ndarray], inputs: list[PlaneSpec]) -> list[np.ndarray]:
        own = self.plan_plane(inputs[0]) if inputs else []
        check_planes(self.layout_id, planes, [*own, *inputs[1:]])
        if not inputs:
            return []
        return [self.inverse_plane(planes[: len(own)], inputs[0]), *planes[len(own) :]]

    # -- shared checks ----------------------------------------------------------------------------
    def check_input(self, spec: PlaneSpec, ndim: int | None = 3) -> DType:
        """The input's kvtool dtype, after checking it is one a lossy stage takes (and a ``[heads, tokens, dim]`` block)."""
        if np.dtype(spec.dtype) not in [DTYPES[name].numpy for name in LOSSY_INPUTS]:
            raise UsageError(
                f"lossy layout {self.layout_id!r} takes {', '.join(LOSSY_INPUTS)} values; plane {spec.name!r} is "
                f"{dtype_name(spec.dtype)}"
            )
        if ndim is not None and len(spec.shape) != ndim:
            raise UsageError(f"lossy layout {self.layout_id!r} takes [heads, tokens, dim] blocks, not shape {list(spec.shape)}")
        return dtype_of(spec.dtype)


def finite_values(layout_id: str, plane: np.ndarray) -> np.ndarray:
    """``plane``'s values as float64 (exact for every input dtype); ``UsageError`` on a NaN or an infinity."""
    with np.errstate(invalid="ignore"):  # a NaN's cast warns; it is refused just below
        values = plane.astype(np.float64)
    if not np.isfinite(values).all():
        raise UsageError(f"lossy layout {layout_id!r} takes finite values only; this block holds NaN or infinity")
    return values


def ulp(magnitude: np.ndarray, exponent_bits: int, mantissa_bits: int) -> np.ndarray:
    """The spacing of a binary float format's values at each ``magnitude`` (subnormals included), as float64."""
    min_exponent = 2 - (1 << (exponent_bits - 1))
    _, exponent = np.frexp(np.abs(magnitude))  # |m| = f * 2**exponent with f in [0.5, 1)
    spacing: np.ndarray = np.ldexp(1.0, np.maximum(exponent - 1, min_exponent) - mantissa_bits)
    return spacing


def rounding_bound(magnitude: np.ndarray, dtype: DType) -> np.ndarray:
    """Half the spacing of ``dtype`` at ``magnitude``: what rounding a value into it may cost."""
    return 0.5 * ulp(magnitude, dtype.exponent_bits, dtype.mantissa_bits)


def int_param(layout_id: str, name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise UsageError(f"layout {layout_id!r}: {name} must be an integer in {lo}..{hi}, not {value!r}")
    return value


def choice_param(layout_id: str, name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise UsageError(f"layout {layout_id!r}: {name} must be one of {', '.join(choices)}, not {value!r}")
    return cast(str, value)


class ErrorTally:
    """What a lossy chain's round trip costs each tensor, summed block by block as a container encodes.

    ``rows()`` gives one row per tensor: ``max_abs`` and ``rms`` of the error,
    and ``rel_rms``, the RMS error over the RMS of the values; numbers keep 6
    significant digits.
    """

    def __init__(self, tensors: Iterable[tuple[int, str, np.ndarray]]):
        self._tensors = [(layer, kind, array.size) for layer, kind, array in tensors]
        self._sums = [[0.0, 0.0, 0.0] for _ in self._tensors]  # worst, sum of squared errors, sum of squares

    @staticmethod
    def block(exact: np.ndarray, approx: np.ndarray) -> tuple[float, float, float]:
        """One block's ``(worst, squared errors, squares)``: computed where the block is, added in order by ``add``.
        The core computes the same bits where it is built; numpy's casts here are the reference."""
        native = error_stats(exact, approx)
        if native is not None:
            return native
        values = exact.astype(np.float64)
        error = approx.astype(np.float64) - values
        return float(np.abs(error).max(initial=0.0)), float(np.square(error).sum()), float(np.square(values).sum())

    def add(self, tensor: int, block: tuple[float, float, float]) -> None:
        sums = self._sums[tensor]
        sums[0] = max(sums[0], block[0])
        sums[1] += block[1]
        sums[2] += block[2]

    def rows(self) -> list[dict[str, Any]]:
        return [
            {"layer": layer, "kind": kind, "max_abs": _digits(worst), "rms": _digits((squares / max(size, 1)) ** 0.5),
             "rel_rms": _digits((squares / total) ** 0.5 if total else 0.0)}
            for (layer, kind, size), (worst, squares, total) in zip(self._tensors, self._sums)
        ]


def bound_violation(tensors: Iterable[tuple[int, str, np.ndarray]], restored: Iterable[np.ndarray], chain: "LayoutChain",
                    chunk_tokens: int, token_start: int = 0) -> str | None:
    """Where a restored cache strays beyond the error bound of ``chain``'s lossy stage (``chain_error_bound``), or None.

    ``tensors`` and ``restored`` list the original and the decoded tensors in
    the same order; the tensors were cut in blocks of ``chunk_tokens``, the first
    token at sequence position ``token_start``.
    """
    for (layer, kind, array), approx in zip(tensors, restored):
        bound = chain.for_kind(kind, layer)
        end = token_start + array.shape[1]
        for start in range(0, array.shape[1], chunk_tokens):
            block = array[:, start : start + chunk_tokens]
            error = np.abs(approx[:, start : start + chunk_tokens].astype(np.float64) - block.astype(np.float64))
            if not (error <= chain_error_bound(bound.for_block(token_start + start, end), block)).all():
                return f"layer {layer} {kind}, tokens from {start}: error {float(error.max()):.4g} over the bound"
    return None


def chain_error_bound(chain: "LayoutChain", block: np.ndarray) -> np.ndarray:
    """The error bound of a lossy chain bound to a tensor (``for_kind``) for each value of ``block``: zero for
    what a side channel before the lossy stage keeps exact, the lossy stage's bound on the rest."""
    exact = np.zeros(block.shape, bool)
    for layout in chain:
        if isinstance(layout, LossyLayout):
            return np.where(exact, 0.0, layout.error_bound(block))
        block, kept = cast(SideChannel, layout).split(block)
        exact |= kept
    raise UsageError(f"layout chain {chain.spec()!r} has no lossy stage")


def lossy_stages(chain: "LayoutChain") -> str:
    """The spec of a lossy chain's stages up to its lossy one (``outliers:0.01|int:3``): what decides its error."""
    specs = []
    for layout in chain:
        specs.append(layout.spec())
        if layout.lossy:
            break
    return "|".join(specs)


def _digits(value: float) -> float:
    return float(f"{value:.6g}")
