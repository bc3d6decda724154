"""The ``.kvd`` model dictionary: what the ``ctxans`` codec knows about a model before it sees a chunk.

A dictionary is a small codebook of *classes*, each a set of symbol
distributions, one per *context*. The codec cuts every float into a symbol
(its sign and its magnitude in half-binade steps, relative to its channel's
reference) and raw low mantissa bits; for each channel of a chunk the encoder
picks the class that codes the channel's symbols in the fewest bits, and each
symbol is coded with that class's distribution for the context the previous
token of the channel left (``context_of`` its symbol). Classes are shapes, not
channels: a channel drifts from text to text and from chunk to chunk, so the
chunk says where each channel sits (its reference) and which shape fits it.

The file is a ``.kvd`` of version 1 (``kvtool.modeldict.filehead``); its payload::

    meta len     u32, then that many bytes of JSON (what it was trained on; informative)
    classes N    u8   1..64
    contexts X   u8   1..32
    start        u8   the context of a channel's first token in a chunk (< X)
    reserved     u8   0
    context_of   u8[64]         the context each symbol leaves for the next token (< X)
    class_freq   u16[64]        the model of a channel's class: classes >= N have 0, the others >= 1
    ref_freq     u16[32]        the model of a channel's reference offset, every entry >= 1
    freq         u16[N][X][64]  per class and context, every entry >= 1

Every frequency table sums to ``2**PROB_BITS``. The dictionary's id is the
first 16 bytes of the SHA-256 of the payload, as 32 hex digits; chunks name
the first 4 bytes of it. docs/FORMAT.md has the codec's side.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from kvtool.modeldict.filehead import DictionaryError, KvdFile, meta_section, read_meta

VERSION = 1

#: A value's symbol is ``sign * 32 + level index``; level index 0 is an escape.
SYMBOLS = 64
LEVELS = 32
#: Level index ``q`` in 1..31 stands for ``level - reference = LOW + q - 1``.
LOW = -22
PROB_BITS = 15
PROB_SCALE = 1 << PROB_BITS
#: A channel's reference is coded as its offset from the chunk's smallest; 31 escapes.
REF_SYMBOLS = 32
MAX_CLASSES = 64
MAX_CONTEXTS = 32
#: Encoder costs are in 1/COST_UNIT bits.
COST_UNIT = 8


@dataclass(frozen=True, eq=False)
class Dictionary(KvdFile):
    """A parsed, validated model dictionary (see the module docstring for the format)."""

    version = VERSION
    freq: np.ndarray  # uint16 [N, X, 64]
    context_of: np.ndarray  # uint8 [64]
    start_context: int
    class_freq: np.ndarray  # uint16 [64]
    ref_freq: np.ndarray  # uint16 [32]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def classes(self) -> int:
        classes: int = self.freq.shape[0]
        return classes

    @property
    def contexts(self) -> int:
        contexts: int = self.freq.shape[1]
        return contexts

    @cached_property
    def payload(self) -> bytes:
        return b"".join([
            meta_section(self.meta),
            struct.pack("<BBBB", self.classes, self.contexts, self.start_context, 0),
            self.context_of.astype(np.uint8).tobytes(),
            self.class_freq.astype("<u2").tobytes(),
            self.ref_freq.astype("<u2").tobytes(),
            self.freq.astype("<u2").tobytes(),
        ])

    @classmethod
    def from_payload(cls, payload: bytes) -> "Dictionary":
        meta, at = read_meta(payload)
        try:
            n, x, start, reserved = struct.unpack_from("<BBBB", payload, at)
            at += 4
            if not (1 <= n <= MAX_CLASSES and 1 <= x <= MAX_CONTEXTS) or reserved:
                raise DictionaryError(f"a .kvd dictionary with {n} classes and {x} contexts")
            sizes = [SYMBOLS, 2 * SYMBOLS, 2 * REF_SYMBOLS, 2 * n * x * SYMBOLS]
            if len(payload) != at + sum(sizes):
                raise DictionaryError("a .kvd dictionary's tables have the wrong size")
            context_of = np.frombuffer(payload, np.uint8, SYMBOLS, at)
            at += sizes[0]
            class_freq = np.frombuffer(payload, "<u2", SYMBOLS, at)
            at += sizes[1]
            ref_freq = np.frombuffer(payload, "<u2", REF_SYMBOLS, at)
            at += sizes[2]
            freq = np.frombuffer(payload, "<u2", n * x * SYMBOLS, at).reshape(n, x, SYMBOLS)
        except (struct.error, ValueError) as exc:
            raise DictionaryError(f"malformed .kvd dictionary ({exc})") from None
        dictionary = cls(freq.astype(np.uint16), context_of.copy(), start, class_freq.astype(np.uint16),
                         ref_freq.astype(np.uint16), meta)
        if dictionary.payload != payload:
            raise DictionaryError("a .kvd dictionary's metadata is not in canonical form")
        return dictionary

    # -- what coders derive from it ----------------------------------------------------------
    @cached_property
    def tables(self) -> "CoderTables":
        return CoderTables.of(self)


def _validate(d: Dictionary) -> None:
    n = d.freq.shape[0] if d.freq.ndim == 3 else 0
    if d.freq.ndim != 3 or not 1 <= n <= MAX_CLASSES or not 1 <= d.freq.shape[1] <= MAX_CONTEXTS or d.freq.shape[2] != SYMBOLS:
        raise DictionaryError(f"dictionary tables must be [1..{MAX_CLASSES}, 1..{MAX_CONTEXTS}, {SYMBOLS}], not {list(d.freq.shape)}")
    if d.context_of.shape != (SYMBOLS,) or np.any(d.context_of >= d.freq.shape[1]):
        raise DictionaryError("dictionary context map out of range")
    if not 0 <= d.start_context < d.freq.shape[1]:
        raise DictionaryError("dictionary start context out of range")
    if d.class_freq.shape != (SYMBOLS,) or np.any(d.class_freq[:n] == 0) or np.any(d.class_freq[n:]):
        raise DictionaryError("dictionary class model: every class needs a frequency, and only they")
    if d.ref_freq.shape != (REF_SYMBOLS,) or np.any(d.ref_freq == 0):
        raise DictionaryError("dictionary reference model: every offset needs a frequency")
    if np.any(d.freq == 0):
        raise DictionaryError("dictionary symbol models: every symbol needs a frequency")
    for table in (d.class_freq[None], d.ref_freq[None], d.freq.reshape(-1, SYMBOLS)):
        if np.any(table.astype(np.int64).sum(axis=1) != PROB_SCALE):
            raise DictionaryError(f"dictionary frequencies must sum to {PROB_SCALE}")


def cost_of(freq: np.ndarray) -> np.ndarray:
    """The cost of a symbol of frequency ``freq`` in 1/COST_UNIT bits, rounded; 0 stands in for frequency 0.

    ``COST_UNIT * log2`` of an integer that is not a power of two is never within
    1e-9 of a half, so any correctly rounded ``log2`` gives these integers.
    """
    f = np.asarray(freq, np.float64)
    bits = PROB_BITS - np.log2(np.where(f > 0, f, PROB_SCALE))
    return np.floor(COST_UNIT * bits + 0.5).astype(np.int64)


@dataclass(frozen=True)
class CoderTables:
    """The tables both implementations of the coder derive from a dictionary, in one place.

    ``freq``/``cum``: uint16 ``[N * X + 2, 64]``, the symbol models of every
    (class, context) pair, then the class model, then the reference model
    (padded with frequency 0 past symbol 31); ``cost``: int32 ``[X * 64, N]``,
    what each symbol costs in each class, for the encoder's choice of class;
    ``class_cost``: int32 ``[N]``.
    """

    freq: np.ndarray
    cum: np.ndarray
    cost: np.ndarray
    class_cost: np.ndarray
    context_of: np.ndarray
    start_context: int
    classes: int
    contexts: int

    @property
    def class_model(self) -> int:
        return self.classes * self.contexts

    @property
    def ref_model(self) -> int:
        return self.classes * self.contexts + 1

    @classmethod
    def of(cls, d: Dictionary) -> "CoderTables":
        n, x = d.classes, d.contexts
        ref = np.zeros(SYMBOLS, np.uint16)
        ref[:REF_SYMBOLS] = d.ref_freq
        freq = np.concatenate([d.freq.reshape(n * x, SYMBOLS), d.class_freq[None], ref[None]]).astype(np.uint16)
        cum = (np.cumsum(freq, axis=1, dtype=np.int64) - freq).astype(np.uint16)
        cost = cost_of(d.freq).transpose(1, 2, 0).reshape(x * SYMBOLS, n).astype(np.int32)
        return cls(freq, cum, np.ascontiguousarray(cost), cost_of(d.class_freq[:n]).astype(np.int32),
                   d.context_of.astype(np.uint8), int(d.start_context), n, x)
