"""Lossy stages: opt-in layouts whose inverse gives back an approximation, within a stated bound.

A lossy stage sits at the head of a recipe's layout chain, where the tensor is
still a float block ``[heads, tokens, dim]`` (bf16, fp16 or fp32), and maps it
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
from kvtool.cache import DTYPES, DType, dtype_of
from kvtool.errors import UsageError
from kvtool.layouts.base import PlaneSpec, PlaneWiseLayout, dtype_name

if TYPE_CHECKING:
    from kvtool.layouts.chain import LayoutChain

#: The dtypes a lossy stage takes: floats wide enough to be worth shrinking.
LOSSY_INPUTS = ("bf16", "fp16", "fp32")


class LossyLayout(PlaneWiseLayout):
    """A plane-wise stage whose inverse approximates its input; subclasses give the bound."""

    lossy = True
    #: How a spec's text becomes each parameter's value (``str`` where not named).
    param_types: ClassVar[dict[str, Callable[[str], Any]]] = {}

    @abc.abstractmethod
    def error_bound(self, block: np.ndarray) -> np.ndarray:
        """For each value of ``block`` (float64, its shape), a bound on ``|value - inverse(forward(block))|``."""

    # -- specs: the main parameter first, the others as NAME=VALUE ------------------------------
    @classmethod
    def from_spec_arg(cls, arg: str):
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
    return np.ldexp(1.0, np.maximum(exponent - 1, min_exponent) - mantissa_bits)


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
    return value


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


def bound_violation(tensors: Iterable[tuple[int, str, np.ndarray]], restored: Iterable[np.ndarray], chain: "LayoutChain", chunk_tokens: int) -> str | None:
    """Where a restored cache strays beyond the error bound of ``chain``'s lossy first stage, or None.

    ``tensors`` and ``restored`` list the original and the decoded tensors in
    the same order; the tensors were cut in blocks of ``chunk_tokens``.
    """
    for (layer, kind, array), approx in zip(tensors, restored):
        stage = cast(LossyLayout, chain.for_kind(kind, layer)[0])
        for start in range(0, array.shape[1], chunk_tokens):
            block = array[:, start : start + chunk_tokens]
            error = np.abs(approx[:, start : start + chunk_tokens].astype(np.float64) - block.astype(np.float64))
            if not (error <= stage.error_bound(block)).all():
                return f"layer {layer} {kind}, tokens from {start}: error {float(error.max()):.4g} over the bound"
    return None


def _digits(value: float) -> float:
    return float(f"{value:.6g}")
