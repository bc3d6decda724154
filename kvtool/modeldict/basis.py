"""The transform dictionary (``.kvd`` version 2): a model's PCA bases, learnt once, for the ``pca`` stage.

For every layer and kind (keys, values) of a model it holds a basis of the
cache's token vectors (the ``heads * dim`` values of one token, heads one after
the other), found by principal component analysis of real caches of the model:
the training vectors' mean, the components ordered by their variance, and the
training values' RMS, which the stage's steps are relative to. Keys may be
de-rotated before their basis is learnt and applied (``frequencies``: the
model's rotary embedding, which spins each channel pair by an angle that grows
with the position). Beside the bases: the tables that code the quantized
coefficients (``classes``: one symbol distribution each, from narrow to wide)
and, per tensor, the rate the coefficients took on the training data at a grid
of steps (``steps``, ``rates``), which turns a target rate into a step.

The file is a ``.kvd`` of version 2 (``kvtool.modeldict.filehead``); its payload
(little-endian)::

    meta          u32 length, then JSON (keys sorted, no spaces): what it was learnt from
    heads, dim    u16, u16           the shape of a token's values: D = heads * dim
    classes C     u8                 1..MAX_CLASSES coefficient tables
    rope          u8                 1: keys are de-rotated before their basis; 0: not
    grid G        u8                 1..MAX_GRID calibration steps
    reserved      u8                 0
    frequencies   f32[dim / 2]       (rope only) angle per position of channel pair (c, c + dim/2), in 0..1
    steps         f32[G]             the calibration steps, relative to a tensor's RMS, increasing
    class model   u16[C + 1]         frequencies of a component's class, 0 meaning "all zero"
    class tables  u16[C][SYMBOLS]    frequencies of the coefficient symbols in each class
    tensors T     u32                1..MAX_TENSORS, in (layer, kind) order, each pair once
    per tensor:
      layer       u32
      kind        u8                 0 keys, 1 values
      reserved    u8[3]              0
      components  u32                r, 1..D: the components kept, by decreasing variance
      rms         f32                the RMS of the training values (> 0)
      mean        f32[D]
      variance    f32[r]             each component's variance on the training data, non-increasing
      rates       f32[G]             bits per value the coefficients took at each step
      basis       i16[r][D]          component i is row i, in units of 2**-14

Every frequency table sums to ``2**PROB_BITS`` with each entry at least 1; every
float is finite. docs/FORMAT.md ("The ``pca`` stage") has the stage's side.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from kvtool.modeldict.filehead import DictionaryError, KvdFile, meta_section, read_meta

VERSION = 2
#: Coefficient symbols: 0, then sign and magnitude class; see ``kvtool.layouts.pca_reference``.
SYMBOLS = 64
PROB_BITS = 11
PROB_SCALE = 1 << PROB_BITS
MAX_CLASSES = 32
MAX_GRID = 64
MAX_TENSORS = 1 << 16
#: Basis entries are integers in units of ``2**-BASIS_BITS`` (a unit vector's entries fit in int16).
BASIS_BITS = 14
KINDS = ("k", "v")
#: A component is coded where its standard deviation is at least the step over this; the others are dropped.
DROP = 4
_HEAD = struct.Struct("<HHBBBB")
_TENSOR = struct.Struct("<IB3xI")


@dataclass(frozen=True, eq=False)
class TensorBasis:
    """The basis of one layer's keys or values: ``basis`` ``[r, D]`` int16 rows, by decreasing ``variance``."""

    layer: int
    kind: str
    rms: float
    mean: np.ndarray  # float32 [D]
    variance: np.ndarray  # float32 [r]
    rates: np.ndarray  # float32 [G]
    basis: np.ndarray  # int16 [r, D]

    @property
    def components(self) -> int:
        return int(self.basis.shape[0])

    def section(self) -> bytes:
        return b"".join([
            _TENSOR.pack(self.layer, KINDS.index(self.kind), self.components), struct.pack("<f", self.rms),
            self.mean.astype("<f4").tobytes(), self.variance.astype("<f4").tobytes(), self.rates.astype("<f4").tobytes(),
            self.basis.astype("<i2").tobytes(),
        ])


@dataclass(frozen=True, eq=False)
class BasisDictionary(KvdFile):
    """A parsed, validated transform dictionary (see the module docstring for the format)."""

    version = VERSION
    heads: int
    dim: int
    frequencies: np.ndarray  # float32 [dim / 2], empty when keys are not de-rotated
    steps: np.ndarray  # float32 [G]
    class_model: np.ndarray  # uint16 [C + 1]
    class_tables: np.ndarray  # uint16 [C, SYMBOLS]
    tensors: tuple[TensorBasis, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def width(self) -> int:
        """D: the values of one token of one tensor."""
        return self.heads * self.dim

    @property
    def rope(self) -> bool:
        return bool(self.frequencies.size)

    @property
    def classes(self) -> int:
        return int(self.class_tables.shape[0])

    @cached_property
    def _by_tensor(self) -> dict[tuple[int, str], TensorBasis]:
        return {(t.layer, t.kind): t for t in self.tensors}

    def basis(self, layer: int, kind: str) -> TensorBasis | None:
        """The basis of ``layer``'s keys (``"k"``) or values (``"v"``), or None where the dictionary has none."""
        return self._by_tensor.get((layer, kind))

    def describe(self) -> str:
        """What the dictionary was learnt from, in a few words: for messages."""
        model = self.meta.get("model", {}) if isinstance(self.meta.get("model"), dict) else {}
        layers = len({t.layer for t in self.tensors})
        return f"{model.get('model_id', 'a model')} ({layers} layers, {self.heads} KV heads x {self.dim})"

    @cached_property
    def payload(self) -> bytes:
        head = _HEAD.pack(self.heads, self.dim, self.classes, int(self.rope), len(self.steps), 0)
        return b"".join([
            meta_section(self.meta), head, self.frequencies.astype("<f4").tobytes(), self.steps.astype("<f4").tobytes(),
            self.class_model.astype("<u2").tobytes(), self.class_tables.astype("<u2").tobytes(),
            struct.pack("<I", len(self.tensors)), *(t.section() for t in self.tensors),
        ])

    @classmethod
    def from_payload(cls, payload: bytes) -> "BasisDictionary":
        meta, at = read_meta(payload)
        reader = _Reader(payload, at)
        try:
            heads, dim, classes, rope, grid, reserved = reader.unpack(_HEAD)
            if reserved or rope > 1 or not (1 <= classes <= MAX_CLASSES and 1 <= grid <= MAX_GRID) or not heads or not dim \
                    or (rope and dim % 2):
                raise DictionaryError(f"a basis dictionary with {heads} x {dim} values, {classes} classes, {grid} steps")
            width = heads * dim
            frequencies = reader.array("<f4", dim // 2 if rope else 0)
            steps = reader.array("<f4", grid)
            class_model = reader.array("<u2", classes + 1)
            class_tables = reader.array("<u2", classes * SYMBOLS).reshape(classes, SYMBOLS)
            (count,) = reader.unpack(struct.Struct("<I"))
            if not 1 <= count <= MAX_TENSORS:
                raise DictionaryError(f"a basis dictionary with {count} tensors")
            tensors = []
            for _ in range(count):
                layer, kind, components = reader.unpack(_TENSOR)
                if kind >= len(KINDS) or not 1 <= components <= width:
                    raise DictionaryError(f"a basis dictionary's tensor of kind {kind} with {components} components")
                (rms,) = reader.unpack(struct.Struct("<f"))
                tensors.append(TensorBasis(
                    layer, KINDS[kind], rms, reader.array("<f4", width), reader.array("<f4", components),
                    reader.array("<f4", grid), reader.array("<i2", components * width).reshape(components, width),
                ))
        except struct.error as exc:
            raise DictionaryError(f"malformed basis dictionary ({exc})") from None
        if reader.at != len(payload):
            raise DictionaryError("a basis dictionary's payload has bytes after its last tensor")
        dictionary = cls(heads, dim, frequencies, steps, class_model, class_tables, tuple(tensors), meta)
        if dictionary.payload != payload:
            raise DictionaryError("a basis dictionary's metadata is not in canonical form")
        return dictionary


def coded_components(variance: np.ndarray, step: np.float32) -> int:
    """How many components of a tensor a step codes: those whose variance is at least ``(step / DROP)**2``
    (a prefix, the variances being non-increasing), compared in float64, where both sides are exact."""
    limit = np.float64(step) * np.float64(step)
    return int(np.count_nonzero(variance.astype(np.float64) * (DROP * DROP) >= limit))


class _Reader:
    """Sections of a payload read in order, each bounded by what is left."""

    def __init__(self, payload: bytes, at: int):
        self.payload, self.at = payload, at

    def unpack(self, layout: struct.Struct) -> tuple[Any, ...]:
        values = layout.unpack_from(self.payload, self.at)
        self.at += layout.size
        return values

    def array(self, dtype: str, count: int) -> np.ndarray:
        size = np.dtype(dtype).itemsize * count
        if self.at + size > len(self.payload):
            raise DictionaryError("a basis dictionary's payload is shorter than its tables")
        values = np.frombuffer(self.payload, dtype, count, self.at)
        self.at += size
        return values.astype(dtype[1:])  # native order, a copy the dictionary owns


def _validate(d: BasisDictionary) -> None:
    tables = [d.class_model[None], d.class_tables]
    if d.class_tables.ndim != 2 or d.class_tables.shape[1] != SYMBOLS or d.class_model.shape != (d.classes + 1,):
        raise DictionaryError(f"a basis dictionary's coefficient tables must be [C, {SYMBOLS}] with a class model of C + 1")
    if any(np.any(t == 0) or np.any(t.astype(np.int64).sum(axis=1) != PROB_SCALE) for t in tables):
        raise DictionaryError(f"a basis dictionary's frequencies must each be >= 1 and sum to {PROB_SCALE}")
    if d.frequencies.size not in (0, d.dim // 2) or not ((d.frequencies >= 0) & (d.frequencies <= 1)).all():
        raise DictionaryError("a basis dictionary's rotary frequencies must lie in 0..1, one per channel pair")
    if d.steps.ndim != 1 or not (np.isfinite(d.steps).all() and (d.steps > 0).all() and (np.diff(d.steps) > 0).all()):
        raise DictionaryError("a basis dictionary's steps must be finite, positive and increasing")
    previous = (-1, -1)
    for t in d.tensors:
        shapes = (t.mean.shape, t.rates.shape, t.basis.shape)
        if shapes != ((d.width,), d.steps.shape, (t.components, d.width)) or t.variance.shape != (t.components,):
            raise DictionaryError(f"a basis dictionary's layer {t.layer} {t.kind} has the wrong shapes")
        floats = np.concatenate([t.mean, t.variance, t.rates, [t.rms]])
        if not np.isfinite(floats).all() or not t.rms > 0 or (t.variance < 0).any() or (np.diff(t.variance) > 0).any():
            raise DictionaryError(f"a basis dictionary's layer {t.layer} {t.kind}: non-finite or unordered statistics")
        if np.abs(t.basis.astype(np.int32)).max() > 1 << BASIS_BITS:
            raise DictionaryError(f"a basis dictionary's layer {t.layer} {t.kind}: basis entries beyond 1")
        key = (t.layer, KINDS.index(t.kind) if t.kind in KINDS else -1)
        if key <= previous:
            raise DictionaryError("a basis dictionary's tensors must be in (layer, kind) order, each once")
        previous = key
