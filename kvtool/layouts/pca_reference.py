"""The ``pca`` stage's block plane in numpy and plain Python: the reference the C core matches bit for bit.

docs/FORMAT.md ("The ``pca`` stage") specifies the bytes; this module is
that text as code. Every number that reaches the plane is computed with IEEE
operations whose results do not depend on the order of a sum or on the CPU
(float32 sums in a fixed order, integer sums, float64 products and
``rint``), so the C core writes the same bytes on any machine, and decoding
sums integers, in any order.

A block ``[heads, n, dim]`` is read as ``n`` token vectors of ``D = heads * dim``
values (heads one after the other). Per token ``t`` (at sequence position
``position + t``), not kept exact:

1. keys of a dictionary with rotary frequencies are de-rotated: each channel
   pair ``(c, c + dim/2)`` of a head turned back by the angle ``(position + t)
   * frequency[c]`` (``rotation``);
2. ``y = v - mean`` (float32), then coefficient ``j`` is the float32 sum over
   ``i = 0 .. D-1``, in that order, of ``y[i] * basis[j, i] * 2**-14``;
3. ``q[j] = rint(coefficient * (1 / step))`` in float64 (halves to even).

A token whose ``|q|`` exceeds ``MAX_Q``, whose ``sum |q|`` reaches
``MAX_SUM``, or whose values could come back beyond the dtype's range, is kept
exact. The inverse: ``S[i] = sum_j q[j] * basis[j, i]`` (an integer), ``v[i] =
float32(float32(S[i]) * (step * 2**-14)) + mean[i]`` in float32, rotated
forward, rounded to the dtype (nearest, ties to even).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from kvtool.dtypes import dtype_of
from kvtool.errors import DecodeError
from kvtool.modeldict import rans
from kvtool.modeldict.basis import BASIS_BITS, PROB_BITS
from kvtool.modeldict.coefficients import MAX_Q, MAX_SYMBOL, choose_classes, magnitude, symbols

VERSION = 1
MODE_EXACT, MODE_CODED = 0, 1
#: mode, version, coded components, dictionary tag, position, stream bytes, extra-bit bytes, exact tokens
HEAD = struct.Struct("<BBH4sQIII")
STATES = 8
MAX_SUM = 1 << 17
#: Sequence positions a plane may hold (an angle of a rotary frequency in 0..1 stays below 2**40).
MAX_POSITION = 1 << 40
#: Room in the plane beyond the block's own bytes: the head, the bitmap and a stream of no tokens fit.
SLACK = 64
#: Taylor coefficients of sin and cos on [-pi/4, pi/4], highest first (Horner's order).
_SIN = (1 / 1307674368000, -1 / 6227020800, 1 / 39916800, -1 / 362880, 1 / 5040, -1 / 120, 1 / 6, -1.0)
_COS = (1 / 20922789888000, -1 / 87178291200, 1 / 479001600, -1 / 3628800, 1 / 40320, -1 / 720, 1 / 24, -1 / 2, 1.0)
HALF_PI = 1.5707963267948966


@dataclass(frozen=True, eq=False)
class Tensor:
    """What coding one tensor's blocks needs: its dictionary's basis rows that are coded, its step, its tables."""

    heads: int
    dim: int
    tag: bytes
    mean: np.ndarray  # float32 [D]
    basis: np.ndarray  # int16 [c, D]: the coded components
    step: np.float32
    frequencies: np.ndarray | None  # float32 [dim / 2]: keys de-rotated; None: not
    freq: list[list[int]]  # model 0: the class model (padded to SYMBOLS), 1..C: the class tables
    cum: list[list[int]]
    table_costs: np.ndarray  # int64 [C, SYMBOLS]: each symbol's cost in each class table, in 1/8 bits
    class_costs: np.ndarray  # int64 [C + 1]: each class's cost
    native: object | None = None  # the C core's coder of the same (``pca_model``), where the core is built

    @property
    def width(self) -> int:
        return self.heads * self.dim


def plane_size(heads: int, tokens: int, dim: int, itemsize: int) -> int:
    """The plane's bytes: room for the head, the bitmap, every token exact, and a stream's states."""
    return HEAD.size + -(-tokens // 8) + tokens * heads * dim * itemsize + SLACK


# -- the transform ------------------------------------------------------------------------------


def rotation(positions: np.ndarray, frequencies: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``(cos, sin)`` ``[tokens, pairs]`` of the angles ``position * frequency``: float64 products reduced
    by multiples of pi/2, Taylor polynomials in Horner's order, then rounded to float32."""
    angle = positions.astype(np.float64)[:, None] * frequencies.astype(np.float64)[None, :]
    k = np.floor(angle / HALF_PI + 0.5)
    r = angle - k * HALF_PI
    r2 = r * r
    s, c = np.zeros_like(r), np.zeros_like(r)
    for a in _SIN:
        s = s * r2 + a
    for a in _COS:
        c = c * r2 + a
    s = -(s * r)  # the last coefficient is -1: r * (1 - r2/6 + ...)
    quadrant = np.mod(k, 4).astype(np.int64)
    sin = np.choose(quadrant, [s, c, -s, -c])
    cos = np.choose(quadrant, [c, -s, -c, s])
    return cos.astype(np.float32), sin.astype(np.float32)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, back: bool) -> np.ndarray:
    """float32 ``[tokens, heads, dim]`` with each channel pair turned by its angle (``back``: by minus it)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    if back:
        return np.concatenate([a * c + b * s, b * c - a * s], axis=-1)
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def centered(block: np.ndarray, tensor: Tensor, position: int) -> np.ndarray:
    """float32 ``[tokens, D]``: each token's values de-rotated (where the tensor's keys are) less the mean (step 1)."""
    tokens = block.shape[1]
    x = np.ascontiguousarray(block.astype(np.float32).transpose(1, 0, 2))
    if tensor.frequencies is not None:
        x = rotate(x, *rotation(np.arange(tokens) + position, tensor.frequencies), back=True)
    y: np.ndarray = x.reshape(tokens, tensor.width) - tensor.mean
    return y


def coefficients(y: np.ndarray, tensor: Tensor) -> np.ndarray:
    """float32 ``[tokens, c]``: each token's coefficients in the coded components (step 2), from ``centered``."""
    tokens = len(y)
    weights = tensor.basis.T.astype(np.float32) * np.float32(2.0**-BASIS_BITS)  # exact
    acc = np.zeros((tokens, tensor.basis.shape[0]), np.float32)
    for i in range(tensor.width):
        acc += y[:, i : i + 1] * weights[i : i + 1]
    return acc


def quantize(acc: np.ndarray, tensor: Tensor) -> np.ndarray:
    """float64 ``q``: the coefficients over the step, rounded to the nearest integer (ties to even); integers,
    as floats because a token kept exact may have some beyond any integer type."""
    inverse = 1.0 / np.float64(tensor.step)
    q: np.ndarray = np.rint(acc.astype(np.float64) * inverse)
    return q


def reconstruct(q: np.ndarray, tensor: Tensor, positions: np.ndarray) -> np.ndarray:
    """float32 ``[tokens, heads, dim]`` that ``q`` ``[tokens, c]`` stands for, rotated forward (the inverse)."""
    sums = q.astype(np.float64) @ tensor.basis.astype(np.float64)  # integers below 2**31: exact in any order
    gain = np.float32(np.float64(tensor.step) * 2.0**-BASIS_BITS)
    v = sums.astype(np.float32) * gain + tensor.mean
    x: np.ndarray = v.reshape(len(q), tensor.heads, tensor.dim)
    if tensor.frequencies is not None:
        x = rotate(x, *rotation(positions, tensor.frequencies), back=False)
    return x


def exact_beyond(q: np.ndarray, tensor: Tensor, dtype: np.dtype) -> np.ndarray:
    """Tokens that must be kept exact: a ``|q|`` over ``MAX_Q``, a ``sum |q|`` of ``MAX_SUM`` or more, or values
    that could come back beyond the dtype's range (``2 * (sum |q| * step + max |mean|)`` at half its maximum)."""
    total = np.abs(q).sum(axis=1)  # exact below MAX_SUM, the only sums that matter
    kind = dtype_of(dtype)
    top = (2.0 - 2.0**-kind.mantissa_bits) * 2.0 ** ((1 << (kind.exponent_bits - 1)) - 1)  # the largest finite value
    reach = 2.0 * (total * np.float64(tensor.step) + float(np.abs(tensor.mean).max(initial=0.0)))
    exact: np.ndarray = (np.abs(q) > MAX_Q).any(axis=1) | (total >= MAX_SUM) | (reach >= top / 2)
    return exact


# -- the coefficients' extra bits --------------------------------------------------------------


def value_of(sym: int, extra: "_Bits") -> int:
    """The ``q`` of symbol ``sym`` (``kvtool.modeldict.coefficients``), reading its extra bits from ``extra``."""
    if sym == 0:
        return 0
    base, nbits, negative = magnitude(sym)
    m = base + extra.read(nbits) if nbits else base
    return -(m + 1) if negative else m + 1


class _Bits:
    """Extra bits read LSB first from a byte string; ``finish`` checks it was read to its last byte, padding zero."""

    def __init__(self, data: bytes):
        self.value, self.size, self.at = int.from_bytes(data, "little"), 8 * len(data), 0

    def read(self, n: int) -> int:
        if self.at + n > self.size:
            raise DecodeError("pca block: its extra bits end early")
        bits = (self.value >> self.at) & ((1 << n) - 1)
        self.at += n
        return bits

    def finish(self) -> None:
        if self.size - self.at >= 8 or self.value >> self.at:
            raise DecodeError("pca block: bytes after its extra bits")


# -- the plane -----------------------------------------------------------------------------------


def encode(block: np.ndarray, tensor: Tensor, position: int, exact: np.ndarray, size: int) -> np.ndarray:
    """The plane (``size`` bytes) of a finite block ``[heads, n, dim]``; ``exact`` marks tokens kept exact."""
    plane = np.zeros(size, np.uint8)
    q = quantize(coefficients(centered(block, tensor, position), tensor), tensor)
    exact = exact | exact_beyond(q, tensor, block.dtype)
    coded = q[~exact].astype(np.int64)
    sym, nbits, extra = symbols(coded)
    cls = choose_classes(sym, tensor.table_costs, tensor.class_costs)
    keep = np.broadcast_to(cls > 0, sym.shape)
    models = np.broadcast_to(cls, sym.shape)[keep]
    stream = rans.encode(cls.tolist() + sym[keep].tolist(), [0] * len(cls) + models.tolist(), tensor.freq, tensor.cum,
                         PROB_BITS, STATES)
    n = nbits[keep]
    bits = ((extra[keep][:, None] >> np.arange(15)) & 1)[np.arange(15) < n[:, None]]
    extra_bytes = np.packbits(bits.astype(np.uint8), bitorder="little").tobytes()
    values = np.ascontiguousarray(block.transpose(1, 0, 2)[exact]).view(np.uint8).tobytes()
    content = b"".join([
        HEAD.pack(MODE_CODED, VERSION, tensor.basis.shape[0], tensor.tag, position, len(stream), len(extra_bytes),
                  int(exact.sum())),
        np.packbits(exact, bitorder="little").tobytes(), values, stream, extra_bytes,
    ])
    if len(content) > size:  # only a crafted or adversarial block: store it as it is
        raw = np.ascontiguousarray(block).view(np.uint8).reshape(-1)
        plane[1 : 1 + raw.size] = raw
        return plane
    plane[: len(content)] = np.frombuffer(content, np.uint8)
    return plane


def decode(plane: np.ndarray, tensor: Tensor, shape: tuple[int, int, int], dtype: np.dtype) -> np.ndarray:
    """The block ``shape`` of ``dtype`` a plane holds; ``DecodeError`` where it is malformed."""
    heads, tokens, dim = shape
    data = np.ascontiguousarray(plane).view(np.uint8).tobytes()
    itemsize = np.dtype(dtype).itemsize
    raw = tokens * heads * dim * itemsize
    if len(data) != plane_size(heads, tokens, dim, itemsize) or data[0] > MODE_CODED:
        raise DecodeError("pca block: not a plane of this block (size or mode)")
    if data[0] == MODE_EXACT:
        _zero_after(data, 1 + raw)
        stored: np.ndarray = np.frombuffer(data, dtype, tokens * heads * dim, 1).reshape(shape).copy()
        return stored
    _, version, components, tag, position, stream_len, extra_len, count = HEAD.unpack_from(data)
    if version != VERSION or tag != tensor.tag or components != tensor.basis.shape[0]:
        raise DecodeError("pca block: another version, dictionary or allocation than the recipe's")
    if position + tokens > MAX_POSITION:
        raise DecodeError("pca block: a position beyond the format's")
    at = HEAD.size
    exact = np.unpackbits(np.frombuffer(data, np.uint8, -(-tokens // 8), at), bitorder="little")
    if int(exact.sum()) != count or exact[tokens:].any():
        raise DecodeError("pca block: its exact tokens do not match their count")
    exact = exact[:tokens].astype(bool)
    at += -(-tokens // 8)
    kept = count * heads * dim * itemsize
    end = at + kept + stream_len + extra_len
    if end > len(data):
        raise DecodeError("pca block: lengths beyond the plane")
    values = np.frombuffer(data, dtype, count * heads * dim, at).reshape(count, heads, dim)
    at += kept
    q = _read_coefficients(data[at : at + stream_len], data[at + stream_len : end], tensor, tokens - count)
    _zero_after(data, end)
    if (np.abs(q).sum(axis=1) >= MAX_SUM).any():
        raise DecodeError("pca block: a token's coefficients are beyond the format's sum")
    out = np.empty((tokens, heads, dim), dtype)
    out[exact] = values
    positions = np.arange(tokens, dtype=np.int64)[~exact] + position
    out[~exact] = reconstruct(q, tensor, positions).astype(dtype)
    return np.ascontiguousarray(out.transpose(1, 0, 2))


def _read_coefficients(stream: bytes, extra_bytes: bytes, tensor: Tensor, tokens: int) -> np.ndarray:
    decoder = rans.Decoder(stream, tensor.freq, tensor.cum, PROB_BITS, STATES, "pca block")
    components = tensor.basis.shape[0]
    cls = [decoder.next(0) for _ in range(components)]
    if max(cls, default=0) >= len(tensor.freq):
        raise DecodeError("pca block: a class beyond the dictionary's")
    extra = _Bits(extra_bytes)
    q = np.zeros((tokens, components), np.int64)
    coded = [j for j in range(components) if cls[j]]
    for t in range(tokens):
        row = q[t]
        for j in coded:
            s = decoder.next(cls[j])
            if s > MAX_SYMBOL:
                raise DecodeError("pca block: a symbol the format does not use")
            row[j] = value_of(s, extra)
            if abs(row[j]) > MAX_Q:
                raise DecodeError("pca block: a coefficient beyond the format's")
    decoder.finish()
    extra.finish()
    return q


def _zero_after(data: bytes, end: int) -> None:
    if any(data[end:]):
        raise DecodeError("pca block: bytes after its content")
