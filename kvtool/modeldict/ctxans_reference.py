"""The ctxans chunk format in numpy and plain Python: the reference the C core must match bit for bit.

Used where the core is not built, and by the tests as the oracle. The C files
(kvtool/_native/ctxans_*.c, ctxans_impl.h) explain the why of each step;
docs/FORMAT.md specifies the bytes.

A block ``[heads, tokens, dim]`` is coded token by token, each token's heads
in order, each head's row of ``dim`` values in order (*coding order*). A value
of a float family with ``E`` exponent and ``M`` mantissa bits splits into its
sign, its *level* (exponent and top mantissa bit, ``E + 1`` bits: half-binade
steps of magnitude) and ``M - 1`` raw low mantissa bits. Each channel
(head, dim position) has a *reference*, the floor of the mean level over the
block's tokens, and a *class* of the dictionary; a value's *symbol* is
``sign * 32 + q``, where ``q = level - reference - LOW + 1`` when that lies in
1..31 and 0 (an escape: the level follows in the escape list) otherwise. A row
equal to an earlier row of the same head is not coded; the chunk names the
earlier row instead.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtool.errors import DecodeError
from kvtool.modeldict import rans
from kvtool.modeldict.format import (
    LEVELS, LOW, MAX_CLASSES, MAX_CONTEXTS, PROB_BITS, REF_SYMBOLS, SYMBOLS, CoderTables,
)
from kvtool.repeats import FLAG_REPEATS, read_repeats, repeat_section, repeated_rows

VERSION = 1
HEAD = struct.Struct("<BB4sHII")  # version, flags, dictionary tag, base reference, escapes, rANS bytes
STATES = 16
RANS_LOW = rans.LOW
#: The most tokens a block may hold (the core's sums stay within 32 bits).
MAX_TOKENS = 1 << 22

#: The format's constants by the names the C core exports them (its ``CTXANS_CONSTANTS``):
#: ``kvtool._native`` refuses a core built with others.
NATIVE_CONSTANTS = {
    "VERSION": VERSION, "FLAG_REPEATS": FLAG_REPEATS, "HEAD_SIZE": HEAD.size, "STATES": STATES,
    "PROB_BITS": PROB_BITS, "RANS_LOW": RANS_LOW, "SYMBOLS": SYMBOLS, "LEVELS": LEVELS, "LOW": LOW,
    "REF_SYMBOLS": REF_SYMBOLS, "MAX_CLASSES": MAX_CLASSES, "MAX_CONTEXTS": MAX_CONTEXTS, "MAX_TOKENS": MAX_TOKENS,
}


@dataclass(frozen=True)
class Family:
    width: int  # bytes per value
    exponent_bits: int
    mantissa_bits: int

    @property
    def raw_bits(self) -> int:
        return self.mantissa_bits - 1

    @property
    def level_count(self) -> int:
        return 1 << (self.exponent_bits + 1)


FAMILIES = {
    "bf16": Family(2, 8, 7),
    "fp16": Family(2, 5, 10),
    "fp32": Family(4, 8, 23),
    "fp8_e4m3": Family(1, 4, 3),
    "fp8_e5m2": Family(1, 5, 2),
}


def fields(bits: np.ndarray, family: Family) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sign, level and raw bits of each value (int64 arrays of ``bits``' shape)."""
    v = bits.astype(np.int64)
    sign = v >> (8 * family.width - 1)
    level = (v >> family.raw_bits) & (family.level_count - 1)
    raw = v & ((1 << family.raw_bits) - 1)
    return sign, level, raw


def contexts(sym: np.ndarray, tables: CoderTables) -> np.ndarray:
    """The context of every symbol ``[tokens, channels]``: what the channel's previous token left."""
    prev = np.empty_like(sym)
    prev[1:] = tables.context_of[sym[:-1]]
    prev[:1] = tables.start_context
    return prev


def symbols(sign: np.ndarray, level: np.ndarray, refs: np.ndarray) -> np.ndarray:
    q = level - refs - LOW + 1
    return sign * LEVELS + np.where((q >= 1) & (q < LEVELS), q, 0)


def _pack_bits(values: np.ndarray, width: int) -> bytes:
    """``values`` (each < 2**width) as an LSB-first bit stream, zero padded to a byte."""
    if not len(values) or not width:
        return b""
    bits = ((values[:, None] >> np.arange(width)) & 1).astype(np.uint8).reshape(-1)
    return np.packbits(bits, bitorder="little").tobytes()




@dataclass(frozen=True)
class Analysis:
    """What ctxans and ctxtans both learn of a block before coding it: each value's level, raw bits, symbol
    and context ``[tokens, channels]``, each channel's reference, each row's repeat distance and whether it
    is coded ``[tokens, heads]``, which values are coded, and each class's cost for each channel."""

    level: np.ndarray
    raw: np.ndarray
    refs: np.ndarray
    sym: np.ndarray
    back: np.ndarray
    coded_rows: np.ndarray
    coded: np.ndarray
    prev: np.ndarray
    totals: np.ndarray  # [channels, classes]


def analyse(block: np.ndarray, family: Family, tables: CoderTables, cost: np.ndarray, class_cost: np.ndarray) -> Analysis:
    """The analysis of a non-empty block ``[heads, tokens, dim]``, with the contexts of ``tables`` and the
    costs of the coder's own models (``cost``, ``class_cost``: what ``tables`` holds for rANS)."""
    heads, tokens, dim = block.shape
    channels = heads * dim
    bits = np.ascontiguousarray(block).view(f"u{family.width}")
    sign, level, raw = (np.moveaxis(a, 0, 1).reshape(tokens, channels) for a in fields(bits, family))
    refs = level.sum(axis=0) // tokens
    sym = symbols(sign, level, refs)
    back = repeated_rows(bits)
    coded_rows = back == 0
    coded = np.repeat(coded_rows, dim, axis=1)

    # Each class's cost for a channel's coded symbols in their contexts, plus the cost of naming the class.
    prev = contexts(sym, tables)
    bins = tables.contexts * SYMBOLS
    pairs = (np.arange(channels) * bins + prev * SYMBOLS + sym)[coded]
    counts = np.bincount(pairs, minlength=channels * bins).reshape(channels, bins)
    totals = counts @ cost.astype(np.int64) + class_cost
    return Analysis(level, raw, refs, sym, back, coded_rows, coded, prev, totals)


def side_information(classes: np.ndarray, refs: np.ndarray, tables: CoderTables) -> tuple[int, list[int], list[int], list[int]]:
    """The base reference, each channel's class and reference offset as symbols with their models, and
    the references the offsets escape."""
    base = int(refs.min())
    offsets = refs - base
    side_syms, side_models, escapes = [], [], []
    for c in range(len(classes)):
        side_syms += [int(classes[c]), int(min(offsets[c], REF_SYMBOLS - 1))]
        side_models += [tables.class_model, tables.ref_model]
        if offsets[c] >= REF_SYMBOLS - 1:
            escapes.append(int(refs[c]))
    return base, side_syms, side_models, escapes


class Escapes:
    """A chunk's escape list, handed out in order; ``finish`` checks that every escape was used."""

    def __init__(self, values: list[int], codec: str):
        self.values, self.codec, self.at = values, codec, 0

    def __call__(self) -> int:
        if self.at == len(self.values):
            raise DecodeError(f"{self.codec}: more escapes than the chunk holds")
        self.at += 1
        return self.values[self.at - 1]

    def finish(self) -> None:
        if self.at != len(self.values):
            raise DecodeError(f"{self.codec}: the chunk holds escapes no symbol uses")


def read_sections(data: bytes, flags: int, shape: tuple[int, int, int], family: Family, n_escapes: int,
                  stream_len: int, codec: str, at: int, held_bits: int = 0) -> tuple[np.ndarray, Escapes, bytes, bytes]:
    """The sections after the head at ``at``: each row's repeat distance ``[tokens, heads]``, the escapes, the
    raw section (the coded values' raw bits, less the last ``held_bits`` where the coder holds them elsewhere;
    ``raw_values`` reads it) and the entropy-coded stream, checked to tile the chunk exactly."""
    heads, tokens, dim = shape
    back = np.zeros((tokens, heads), np.int64)
    if flags & FLAG_REPEATS:
        if len(data) < at + 4:
            raise DecodeError(f"{codec}: truncated chunk")
        (length,) = struct.unpack_from("<I", data, at)
        at += 4
        back = read_repeats(data[at : at + length], tokens, heads, codec)
        at += length
    raw_len = (max(coded_values(back, dim) * family.raw_bits - held_bits, 0) + 7) // 8
    if len(data) != at + 2 * n_escapes + raw_len + stream_len:
        raise DecodeError(f"{codec}: the chunk's sections do not add up to its length")
    escapes = Escapes(np.frombuffer(data, "<u2", n_escapes, at).tolist(), codec)
    at += 2 * n_escapes
    return back, escapes, data[at : at + raw_len], data[at + raw_len :]


def coded_values(back: np.ndarray, dim: int) -> int:
    """How many values a block with these repeat distances ``[tokens, heads]`` codes (its rows not repeated)."""
    return int((back == 0).sum()) * dim


def raw_values(section: bytes, count: int, width: int, tail: np.ndarray | None = None) -> list[int]:
    """The ``count`` raw fields of ``width`` bits of a raw section, each LSB first; ``tail``: the bits (LSB first)
    that follow the section's where a coder held the last ones elsewhere."""
    bits = np.unpackbits(np.frombuffer(section, np.uint8), bitorder="little").astype(np.int64)
    if tail is not None:
        bits = np.concatenate([bits[: count * width - len(tail)], tail.astype(np.int64)])
    if not count or not width:
        return [0] * count
    values: list[int] = (bits[: count * width].reshape(count, width) << np.arange(width)).sum(axis=1).tolist()
    return values


def read_channels(next_symbol: Callable[[int], int], channels: int, base: int, family: Family, tables: CoderTables,
                  escape: Escapes, codec: str) -> tuple[list[int], list[int]]:
    """Each channel's class and reference, decoded with ``next_symbol(model)``."""
    classes, refs = [], []
    for _ in range(channels):
        classes.append(next_symbol(tables.class_model))
        offset = next_symbol(tables.ref_model)
        ref = escape() if offset == REF_SYMBOLS - 1 else base + offset
        if ref >= family.level_count:
            raise DecodeError(f"{codec}: a channel reference is out of range")
        refs.append(ref)
    return classes, refs


def encode(block: np.ndarray, dtype_name: str, tables: CoderTables, tag: bytes) -> bytes:
    """The ctxans chunk of a block ``[heads, tokens, dim]`` (any strides)."""
    family = FAMILIES[dtype_name]
    if not block.size:
        return HEAD.pack(VERSION, 0, tag, 0, 0, 0)
    x = analyse(block, family, tables, tables.cost, tables.class_cost)
    classes = np.argmin(x.totals, axis=1)  # the cheapest class, the lowest on a tie
    base, side_syms, side_models, escapes = side_information(classes, x.refs, tables)
    models = classes[None, :] * tables.contexts + x.prev
    value_syms, value_models = x.sym[x.coded].tolist(), models[x.coded].tolist()
    escapes += x.level[x.coded][x.sym[x.coded] % LEVELS == 0].tolist()
    stream = rans.encode(side_syms + value_syms, side_models + value_models, tables.freq.tolist(), tables.cum.tolist(),
                         PROB_BITS, STATES)
    flags, repeats = repeat_section(x.back, x.coded_rows)
    return b"".join([
        HEAD.pack(VERSION, flags, tag, base, len(escapes), len(stream)),
        repeats,
        np.array(escapes, "<u2").tobytes(),
        _pack_bits(x.raw[x.coded], family.raw_bits),
        stream,
    ])


def decode(chunk: bytes | memoryview, dtype_name: str, shape: tuple[int, int, int], tables: CoderTables, tag: bytes) -> np.ndarray:
    """The block a ctxans chunk holds, as unsigned integers of the dtype's width; ``DecodeError`` if malformed."""
    family = FAMILIES[dtype_name]
    heads, tokens, dim = shape
    channels = heads * dim
    data = bytes(chunk)
    if len(data) < HEAD.size:
        raise DecodeError("ctxans: truncated chunk")
    version, flags, chunk_tag, base, n_escapes, stream_len = HEAD.unpack_from(data)
    if version != VERSION or flags & ~FLAG_REPEATS:
        raise DecodeError("ctxans: not a chunk of this format")
    if chunk_tag != tag:
        raise DecodeError(f"ctxans: the chunk was coded with another dictionary ({chunk_tag.hex()}..., not {tag.hex()}...)")
    out = np.zeros((tokens, heads, dim), f"u{family.width}")
    if not heads * tokens * dim:
        if len(data) != HEAD.size or flags or base or n_escapes or stream_len:
            raise DecodeError("ctxans: an empty block's chunk holds data")
        return np.moveaxis(out, 0, 1)
    back, escape, section, stream = read_sections(data, flags, shape, family, n_escapes, stream_len, "ctxans", HEAD.size)
    raw = raw_values(section, coded_values(back, dim), family.raw_bits)
    decoder = rans.Decoder(stream, tables.freq.tolist(), tables.cum.tolist(), PROB_BITS, STATES, "ctxans")
    classes, refs = read_channels(decoder.next, channels, base, family, tables, escape, "ctxans")
    context_of = tables.context_of.tolist()
    prev = [tables.start_context] * channels
    sign_shift, raw_bits = 8 * family.width - 1, family.raw_bits
    raw_at = 0
    for t in range(tokens):
        for h in range(heads):
            row = out[t, h]
            if back[t, h]:
                if back[t, h] > t:
                    raise DecodeError("ctxans: a repeated row points before the block")
                row[:] = out[t - back[t, h], h]
                sign, levels, _ = fields(row, family)
                syms = symbols(sign, levels, np.array(refs[h * dim : (h + 1) * dim])).tolist()
                for d in range(dim):
                    prev[h * dim + d] = context_of[syms[d]]
                continue
            for d in range(dim):
                c = h * dim + d
                s = decoder.next(classes[c] * tables.contexts + prev[c])
                prev[c] = context_of[s]
                q = s % LEVELS
                level = escape() if q == 0 else refs[c] + LOW + q - 1
                if not 0 <= level < family.level_count:
                    raise DecodeError("ctxans: a level is out of range")
                row[d] = (s // LEVELS) << sign_shift | level << raw_bits | raw[raw_at]
                raw_at += 1
    decoder.finish()
    escape.finish()
    return np.moveaxis(out, 0, 1)
