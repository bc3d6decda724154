"""The ctxtans chunk format in numpy and plain Python: the reference the C core must match bit for bit.

Used where the core is not built, and by the tests as the oracle. ctxtans
codes what ctxans codes (each value's sign, level relative to its channel's
reference, in the context its channel's previous token left, with the models
of the channel's dictionary class; repeated rows named; low mantissa bits
raw; see ``ctxans_reference``), but with tANS: every model is a table of
``TABLE_SIZE`` states (``ctxtans_tables``), so decoding a value is one table
step. A chunk whose symbols the dictionary codes worse than a Huffman code of
the chunk's own statistics would is an ``exphuff`` chunk instead (mode 1).
docs/FORMAT.md specifies the bytes.

Chunk version 3 (what the encoder writes) gives every channel of a group of
64 its own state, in rANS rather than tANS: the channels of a group are the
lanes of SIMD registers, each lane's symbols the chain of one channel, so a
decoder steps all of them at once (``ctxtans_lanes_reference``). Versions 1
and 2 (eight tANS states taking the symbols in turn) still decode.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass
from typing import cast

import numpy as np

from kvtool._native import ctxtans_lanes_reference as lanes
from kvtool._native import reference as exphuff
from kvtool.modeldict.ctxans_reference import (
    FAMILIES, Escapes, Family, _pack_bits, analyse, coded_values, raw_values, read_channels, read_sections,
    side_information,
)
from kvtool._native.ctxtans_tables import TABLE_LOG, TABLE_SIZE, TansTables
from kvtool.errors import DecodeError
from kvtool.modeldict.format import LEVELS, LOW, SYMBOLS, CoderTables
from kvtool.repeats import repeat_section

#: What the encoder writes; chunks of versions 1 and 2 still decode.
VERSION = 3
MODE_DICT, MODE_EXPHUFF = 0, 1
#: version, mode, flags, reserved, dictionary tag, base reference, escapes, stream bytes
HEAD = struct.Struct("<BBBB4sHII")
FLAG_REPEATS = 1


@dataclass(frozen=True)
class Layout:
    """What a chunk version fixes. Values are coded a ``group`` of channels at a time, each group's tokens in
    order, so a decoder sweeps the tables of a few channels' classes at a time (they stay in cache).
    ``sorted``: each head's channels in class order (else in their own). ``lanes``: the stream is version 3's
    rANS lanes, a group is a head's channels ``group`` at a time, a value's state is its channel's place in
    the group, and the raw bits and escaped levels of the values are in the block's order (token, head, dim);
    else the stream is tANS, symbol ``i`` takes state ``i % states``, and both follow the coding order."""

    states: int
    group: int
    sorted: bool
    lanes: bool


LAYOUTS = {1: Layout(8, 8, False, False), 2: Layout(8, 8, True, False), 3: Layout(lanes.LANES, lanes.LANES, True, True)}

__all__ = ["FAMILIES", "decode", "encode"]


# -- the tANS stream --------------------------------------------------------------------------


def _tans_encode(syms: list[int], models: list[int], coders: list[int], initial: list[int], t: TansTables) -> bytes:
    """The stream of ``syms``, symbol ``i`` coded with model ``models[i]`` by state ``coders[i]``, the states starting
    from ``initial`` (``TABLE_SIZE`` plus what the decoder's final states are)."""
    g, start, enc = t.g.tolist(), t.start.tolist(), t.encode.tolist()
    states = list(initial)
    values: list[int] = []
    widths: list[int] = []
    for i in range(len(syms) - 1, -1, -1):
        s, m, k = syms[i], models[i], coders[i]
        x, f = states[k], g[m][s]
        nb = TABLE_LOG - (f.bit_length() - 1)
        if x >> nb < f:
            nb -= 1
        values.append(x & ((1 << nb) - 1))
        widths.append(nb)
        states[k] = TABLE_SIZE + enc[m][start[m][s] + (x >> nb) - f]
    values += [x - TABLE_SIZE for x in states] + [1]
    widths += [TABLE_LOG] * len(states) + [1]
    return _pack_fields(np.array(values, np.int64), np.array(widths, np.int64))


def _pack_fields(values: np.ndarray, widths: np.ndarray) -> bytes:
    """Fields of ``widths`` bits back to back, each LSB first, zero padded to a byte."""
    at = np.cumsum(widths) - widths
    total = int(widths.sum())
    bits = np.zeros((total + 7) // 8 * 8, np.uint8)
    for j in range(int(widths.max(initial=0))):
        has = widths > j
        bits[at[has] + j] = (values[has] >> j) & 1
    return np.packbits(bits, bitorder="little").tobytes()


class _TansDecoder:
    """Reads the stream from its end: the states, then each symbol's bits in coding order."""

    def __init__(self, data: bytes, t: TansTables, n_states: int):
        if not data or not data[-1]:
            raise DecodeError("ctxtans: the entropy-coded stream has no end marker")
        bits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little").astype(np.int64)
        self.pos = 8 * (len(data) - 1) + int(data[-1]).bit_length() - 1
        # window[p]: the TABLE_LOG bits from bit p, LSB first (zeros past the end)
        padded = np.concatenate([bits[: self.pos], np.zeros(TABLE_LOG, np.int64)])
        window = np.zeros(self.pos + 1, np.int64)
        for j in range(TABLE_LOG):
            window |= padded[j : j + self.pos + 1] << j
        self.window: list[int] = window.tolist()
        self.symbol: list[list[int]] = t.symbol.tolist()
        self.nbits: list[list[int]] = t.nbits.tolist()
        self.base: list[list[int]] = t.base.tolist()
        self.states = [0] * n_states
        for k in range(n_states - 1, -1, -1):
            self.states[k] = self._read(TABLE_LOG)
        self.i = 0

    def _read(self, nb: int) -> int:
        if nb > self.pos:
            raise DecodeError("ctxtans: the entropy-coded stream ends early")
        self.pos -= nb
        return self.window[self.pos] & ((1 << nb) - 1)

    def next(self, model: int, state: int | None = None) -> int:
        """The next symbol, decoded with ``model`` by ``state`` (the next in turn when None)."""
        k = self.i % len(self.states) if state is None else state
        self.i += 1
        u = self.states[k]
        self.states[k] = self.base[model][u] + self._read(self.nbits[model][u])
        return self.symbol[model][u]

    def finish(self) -> None:
        if self.pos or any(self.states):
            raise DecodeError("ctxtans: the entropy-coded stream does not end where its symbols do")


# -- chunks -----------------------------------------------------------------------------------


def coding_channels(classes: np.ndarray, dim: int, version: int) -> np.ndarray:
    """The channels in coding order: from version 2 on each head's channels sorted by class (stable), so a
    group sweeps the tables of fewer classes; in version 1 in their own order."""
    channels = np.arange(len(classes))
    if not LAYOUTS[version].sorted:
        return channels
    heads = channels.reshape(-1, dim)
    return np.concatenate([h[np.argsort(classes[h], kind="stable")] for h in heads])


def groups(channels: int, dim: int, layout: Layout) -> list[range]:
    """The groups of places of the coding order: with lanes, each head's places 64 at a time (a head's last group
    may be smaller); else the whole order's, ``layout.group`` at a time."""
    if layout.lanes:
        return lanes.groups(channels, dim)
    return [range(g, min(g + layout.group, channels)) for g in range(0, channels, layout.group)]


def coding_order(tokens: int, chan: np.ndarray, dim: int, layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The values of ``[tokens, channels]`` in coding order, as flat positions, as each one's lane (its place in
    its group) and as its step (its group's number times ``tokens`` plus its token): the groups of ``chan``
    (the channels in coding order) in turn, each token by token."""
    places = np.broadcast_to(np.arange(len(chan)), (tokens, len(chan)))
    grid = np.arange(tokens * len(chan)).reshape(tokens, len(chan))[:, chan]
    cut = groups(len(chan), dim, layout)
    token = np.broadcast_to(np.arange(tokens)[:, None], (tokens, len(chan)))
    return (np.concatenate([grid[:, g.start : g.stop].reshape(-1) for g in cut]),
            np.concatenate([places[:, g.start : g.stop].reshape(-1) - g.start for g in cut]),
            np.concatenate([token[:, g.start : g.stop].reshape(-1) + n * tokens for n, g in enumerate(cut)]))


def steps_of(keys: np.ndarray, first: int) -> list[range]:
    """The runs of equal ``keys`` (in order), as ranges of indices from ``first`` on."""
    cuts = [0, *(np.flatnonzero(np.diff(keys)) + 1).tolist(), len(keys)]
    return [range(first + a, first + b) for a, b in itertools.pairwise(cuts) if b > a]


def _use_exphuff(best: np.ndarray, value_syms: np.ndarray) -> bool:
    """Whether a Huffman code of the chunk's own symbol counts beats the dictionary's cost (both in integers)."""
    hist = np.zeros(256, np.int64)
    hist[:SYMBOLS] = np.bincount(value_syms, minlength=SYMBOLS)
    lengths = exphuff.huffman_lengths(hist).astype(np.int64)
    return int(8 * (hist * lengths).sum()) < int(best.sum())


def encode(block: np.ndarray, dtype_name: str, t: TansTables, tag: bytes, version: int = VERSION) -> bytes:
    """The ctxtans chunk of a block ``[heads, tokens, dim]`` (any strides); ``version`` 1 or 2 writes the
    chunks of those versions (what older files hold)."""
    family = FAMILIES[dtype_name]
    layout = LAYOUTS[version]
    _, tokens, dim = block.shape
    if not block.size:
        return HEAD.pack(version, MODE_DICT, 0, 0, tag, 0, 0, 0)
    ct = t.coder
    x = analyse(block, family, ct, t.cost, t.class_cost)
    classes = np.argmin(x.totals, axis=1)  # the cheapest class, the lowest on a tie
    if _use_exphuff(x.totals.min(axis=1), x.sym[x.coded]):
        return bytes([version, MODE_EXPHUFF]) + exphuff.encode(block, dtype_name)
    base, side_syms, side_models, escapes = side_information(classes, x.refs, ct)
    order, value_lanes, keys = coding_order(tokens, coding_channels(classes, dim, version), dim, layout)
    coded = x.coded.reshape(-1)[order]
    order, value_lanes, keys = order[coded], value_lanes[coded], keys[coded]  # the coded values in coding order

    def ordered(a: np.ndarray) -> np.ndarray:
        in_order: np.ndarray = a.reshape(-1)[order]
        return in_order

    models = classes[None, :] * ct.contexts + x.prev
    syms = side_syms + ordered(x.sym).tolist()
    models_of = side_models + ordered(models).tolist()
    side_states = (np.arange(len(side_syms)) % layout.states).tolist()
    if layout.lanes:  # a value's state is its lane; raw bits and escapes in the block's order; rANS
        sym, level = x.sym[x.coded], x.level[x.coded]
        bits = ((x.raw[x.coded][:, None] >> np.arange(family.raw_bits)) & 1).reshape(-1)
        held = min(len(bits), lanes.HELD_BITS)  # the last raw bits, which the states start from
        raw = np.packbits(bits[: len(bits) - held].astype(np.uint8), bitorder="little").tobytes()
        steps = [range(i, i + 1) for i in range(len(side_syms))] + steps_of(keys, len(side_syms))
        stream = lanes.encode(steps, syms, models_of, side_states + value_lanes.tolist(),
                              lanes.initial_states(bits[len(bits) - held :]), t.g.tolist(), t.start.tolist())
    else:
        value_states = (len(side_syms) + np.arange(len(order))) % layout.states
        sym, level = ordered(x.sym), ordered(x.level)
        raw = _pack_bits(ordered(x.raw), family.raw_bits)
        stream = _tans_encode(syms, models_of, side_states + value_states.tolist(), [TABLE_SIZE] * layout.states, t)
    escapes += level[sym % LEVELS == 0].tolist()
    flags, repeats = repeat_section(x.back, x.coded_rows)
    return b"".join([
        HEAD.pack(version, MODE_DICT, flags, 0, tag, base, len(escapes), len(stream)),
        repeats,
        np.array(escapes, "<u2").tobytes(),
        raw,
        stream,
    ])


def decode(chunk: bytes | memoryview, dtype_name: str, shape: tuple[int, int, int], t: TansTables, tag: bytes) -> np.ndarray:
    """The block a ctxtans chunk holds, as unsigned integers of the dtype's width; ``DecodeError`` if malformed."""
    family = FAMILIES[dtype_name]
    heads, tokens, dim = shape
    channels = heads * dim
    data = bytes(chunk)
    if len(data) >= 2 and data[0] in LAYOUTS and data[1] == MODE_EXPHUFF:
        if not heads * tokens * dim:
            raise DecodeError("ctxtans: an empty block's chunk holds data")
        return exphuff.decode(data[2:], dtype_name, shape)
    if len(data) < HEAD.size:
        raise DecodeError("ctxtans: truncated chunk")
    version, mode, flags, reserved, chunk_tag, base, n_escapes, stream_len = HEAD.unpack_from(data)
    if version not in LAYOUTS or mode != MODE_DICT or flags & ~FLAG_REPEATS or reserved:
        raise DecodeError("ctxtans: not a chunk of this format")
    if chunk_tag != tag:
        raise DecodeError(f"ctxtans: the chunk was coded with dictionary {chunk_tag.hex()}..., not {tag.hex()}...")
    out = np.zeros((tokens, heads, dim), f"u{family.width}")
    if not heads * tokens * dim:
        if len(data) != HEAD.size or flags or base or n_escapes or stream_len:
            raise DecodeError("ctxtans: an empty block's chunk holds data")
        return np.moveaxis(out, 0, 1)
    layout = LAYOUTS[version]
    held = lanes.HELD_BITS if layout.lanes else 0
    back, escape, raw, stream = read_sections(data, flags, shape, family, n_escapes, stream_len, "ctxtans", HEAD.size, held)
    tans = lanes.Decoder(stream, t.g.tolist(), t.start.tolist()) if layout.lanes else _TansDecoder(stream, t, layout.states)
    # the models give no symbol of frequency 0: no class past N, no offset past 31
    classes, refs = read_channels(tans.next, channels, base, family, t.coder, escape, "ctxtans")
    chan = coding_channels(np.array(classes, np.int64), dim, version).tolist()
    values = _Values(tans, back, escape, raw, classes, refs, chan, layout, family, t.coder)
    if layout.lanes:
        values.lanes(out)
    else:
        values.in_turn(out)
    tans.finish()
    escape.finish()
    return np.moveaxis(out, 0, 1)


@dataclass
class _Values:
    """What a chunk's values are decoded from: its stream, repeats, escapes and raw bits, and each channel's class
    and reference; ``chan`` the channels in coding order."""

    tans: _TansDecoder | lanes.Decoder
    back: np.ndarray
    escape: Escapes
    raw: bytes  # the raw section
    classes: list[int]
    refs: list[int]
    chan: list[int]
    layout: Layout
    family: Family
    coder: CoderTables

    def value(self, s: int, c: int, raw: int) -> int:
        """The value of symbol ``s`` in channel ``c``, with its raw bits."""
        q = s % LEVELS
        level = self.escape() if q == 0 else self.refs[c] + LOW + q - 1
        if not 0 <= level < self.family.level_count:
            raise DecodeError("ctxtans: a level is out of range")
        return (s // LEVELS) << (8 * self.family.width - 1) | level << self.family.raw_bits | raw

    def model(self, c: int, context: int) -> int:
        return self.classes[c] * self.coder.contexts + context

    def in_turn(self, out: np.ndarray) -> None:
        """Versions 1 and 2: the values in coding order, each with the next state in turn, its raw bits and
        escape in that order too; a repeated row's contexts from the values it copies."""
        tokens, heads, dim = out.shape
        family, back = self.family, self.back
        context_of = self.coder.context_of.tolist()
        prev = [self.coder.start_context] * (heads * dim)
        sign_shift, raw_bits, levels = 8 * family.width - 1, family.raw_bits, family.level_count
        raw = raw_values(self.raw, coded_values(back, dim), raw_bits)
        raw_at = 0
        for g in groups(heads * dim, dim, self.layout):
            for tok in range(tokens):
                for c in self.chan[g.start : g.stop]:
                    h, d = divmod(c, dim)
                    if back[tok, h]:
                        if back[tok, h] > tok:
                            raise DecodeError("ctxtans: a repeated row points before the block")
                        v = int(out[tok - back[tok, h], h, d])
                        out[tok, h, d] = v
                        q = (v >> raw_bits & levels - 1) - self.refs[c] - LOW + 1
                        prev[c] = context_of[(v >> sign_shift) * LEVELS + (q if 1 <= q < LEVELS else 0)]
                        continue
                    s = cast(_TansDecoder, self.tans).next(self.model(c, prev[c]))
                    prev[c] = context_of[s]
                    out[tok, h, d] = self.value(s, c, raw[raw_at])
                    raw_at += 1

    def lanes(self, out: np.ndarray) -> None:
        """Version 3: first every symbol, in coding order, each channel's with the state of its lane (a repeated
        row's symbols are those of the row it repeats); then the values in the block's order, with their raw
        bits (the last of them from the final states) and escapes in that order."""
        tokens, heads, dim = out.shape
        channels = heads * dim
        context_of = self.coder.context_of.tolist()
        prev = [self.coder.start_context] * channels
        sym = [[0] * channels for _ in range(tokens)]
        decoder = cast(lanes.Decoder, self.tans)
        for g in groups(channels, dim, self.layout):
            for tok in range(tokens):
                coded = []  # (channel, lane)
                for place in g:
                    c = self.chan[place]
                    b = int(self.back[tok, c // dim])
                    if b > tok:
                        raise DecodeError("ctxtans: a repeated row points before the block")
                    if b:
                        sym[tok][c] = sym[tok - b][c]
                        prev[c] = context_of[sym[tok][c]]
                    else:
                        coded.append((c, place - g.start))
                for (c, _), s in zip(coded, decoder.step([(self.model(c, prev[c]), lane) for c, lane in coded])):
                    sym[tok][c] = s
                    prev[c] = context_of[s]
        count = coded_values(self.back, dim)
        held = decoder.held_bits(min(count * self.family.raw_bits, lanes.HELD_BITS))
        raw = raw_values(self.raw, count, self.family.raw_bits, held)
        raw_at = 0
        for tok in range(tokens):
            for h in range(heads):
                if self.back[tok, h]:
                    out[tok, h] = out[tok - self.back[tok, h], h]
                    continue
                for d in range(dim):
                    c = h * dim + d
                    out[tok, h, d] = self.value(sym[tok][c], c, raw[raw_at])
                    raw_at += 1
