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
"""

from __future__ import annotations

import struct

import numpy as np

from kvtool._native import reference as exphuff
from kvtool.modeldict.ctxans_reference import (
    FAMILIES, _pack_bits, analyse, read_channels, read_sections, side_information,
)
from kvtool._native.ctxtans_tables import TABLE_LOG, TABLE_SIZE, TansTables
from kvtool.errors import DecodeError
from kvtool.modeldict.format import LEVELS, LOW, SYMBOLS
from kvtool.repeats import repeat_section

#: What the encoder writes; version 1 chunks (channels in their own order) still decode.
VERSION = 2
MODE_DICT, MODE_EXPHUFF = 0, 1
#: version, mode, flags, reserved, dictionary tag, base reference, escapes, stream bytes
HEAD = struct.Struct("<BBBB4sHII")
FLAG_REPEATS = 1
STATES = 8
#: Values are coded a group of channels at a time, each group's tokens in order, so a decoder
#: sweeps the tables of a few channels' classes at a time (they stay in cache), not all at once.
GROUP = 8

__all__ = ["FAMILIES", "decode", "encode"]


# -- the tANS stream --------------------------------------------------------------------------


def _tans_encode(syms: list[int], models: list[int], t: TansTables) -> bytes:
    """The stream of ``syms``, symbol ``i`` coded with model ``models[i]`` by state ``i % STATES``."""
    g, start, enc = t.g.tolist(), t.start.tolist(), t.encode.tolist()
    states = [TABLE_SIZE] * STATES
    values: list[int] = []
    widths: list[int] = []
    for i in range(len(syms) - 1, -1, -1):
        s, m = syms[i], models[i]
        x, f = states[i % STATES], g[m][s]
        nb = TABLE_LOG - (f.bit_length() - 1)
        if x >> nb < f:
            nb -= 1
        values.append(x & ((1 << nb) - 1))
        widths.append(nb)
        states[i % STATES] = TABLE_SIZE + enc[m][start[m][s] + (x >> nb) - f]
    values += [x - TABLE_SIZE for x in states] + [1]
    widths += [TABLE_LOG] * STATES + [1]
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

    def __init__(self, data: bytes, t: TansTables):
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
        self.states = [0] * STATES
        for k in range(STATES - 1, -1, -1):
            self.states[k] = self._read(TABLE_LOG)
        self.i = 0

    def _read(self, nb: int) -> int:
        if nb > self.pos:
            raise DecodeError("ctxtans: the entropy-coded stream ends early")
        self.pos -= nb
        return self.window[self.pos] & ((1 << nb) - 1)

    def next(self, model: int) -> int:
        k = self.i % STATES
        self.i += 1
        u = self.states[k]
        self.states[k] = self.base[model][u] + self._read(self.nbits[model][u])
        return self.symbol[model][u]

    def finish(self) -> None:
        if self.pos or any(self.states):
            raise DecodeError("ctxtans: the entropy-coded stream does not end where its symbols do")


# -- chunks -----------------------------------------------------------------------------------


def coding_channels(classes: np.ndarray, dim: int, version: int) -> np.ndarray:
    """The channels in coding order: in version 2 each head's channels sorted by class (stable), so a
    group sweeps the tables of fewer classes; in version 1 in their own order."""
    channels = np.arange(len(classes))
    if version < 2:
        return channels
    heads = channels.reshape(-1, dim)
    return np.concatenate([h[np.argsort(classes[h], kind="stable")] for h in heads])


def coding_order(tokens: int, chan: np.ndarray) -> np.ndarray:
    """The positions in ``[tokens, channels]`` (flat) in coding order: groups of GROUP channels of ``chan``
    (the channels in coding order), each group token by token."""
    grid = np.arange(tokens * len(chan)).reshape(tokens, len(chan))[:, chan]
    return np.concatenate([grid[:, g : g + GROUP].reshape(-1) for g in range(0, len(chan), GROUP)])


def _use_exphuff(best: np.ndarray, value_syms: np.ndarray) -> bool:
    """Whether a Huffman code of the chunk's own symbol counts beats the dictionary's cost (both in integers)."""
    hist = np.zeros(256, np.int64)
    hist[:SYMBOLS] = np.bincount(value_syms, minlength=SYMBOLS)
    lengths = exphuff.huffman_lengths(hist).astype(np.int64)
    return int(8 * (hist * lengths).sum()) < int(best.sum())


def encode(block: np.ndarray, dtype_name: str, t: TansTables, tag: bytes, version: int = VERSION) -> bytes:
    """The ctxtans chunk of a block ``[heads, tokens, dim]`` (any strides); ``version`` 1 writes the
    chunks of the first version (what older files hold)."""
    family = FAMILIES[dtype_name]
    _, tokens, dim = block.shape
    if not block.size:
        return HEAD.pack(version, MODE_DICT, 0, 0, tag, 0, 0, 0)
    ct = t.coder
    x = analyse(block, family, ct, t.cost, t.class_cost)
    classes = np.argmin(x.totals, axis=1)  # the cheapest class, the lowest on a tie
    if _use_exphuff(x.totals.min(axis=1), x.sym[x.coded]):
        return bytes([version, MODE_EXPHUFF]) + exphuff.encode(block, dtype_name)
    base, side_syms, side_models, escapes = side_information(classes, x.refs, ct)
    order = coding_order(tokens, coding_channels(classes, dim, version))
    order = order[x.coded.reshape(-1)[order]]  # the coded values in coding order

    def ordered(a: np.ndarray) -> np.ndarray:
        in_order: np.ndarray = a.reshape(-1)[order]
        return in_order

    models = classes[None, :] * ct.contexts + x.prev
    escapes += ordered(x.level)[ordered(x.sym) % LEVELS == 0].tolist()
    stream = _tans_encode(side_syms + ordered(x.sym).tolist(), side_models + ordered(models).tolist(), t)
    flags, repeats = repeat_section(x.back, x.coded_rows)
    return b"".join([
        HEAD.pack(version, MODE_DICT, flags, 0, tag, base, len(escapes), len(stream)),
        repeats,
        np.array(escapes, "<u2").tobytes(),
        _pack_bits(ordered(x.raw), family.raw_bits),
        stream,
    ])


def decode(chunk: bytes | memoryview, dtype_name: str, shape: tuple[int, int, int], t: TansTables, tag: bytes) -> np.ndarray:
    """The block a ctxtans chunk holds, as unsigned integers of the dtype's width; ``DecodeError`` if malformed."""
    family = FAMILIES[dtype_name]
    heads, tokens, dim = shape
    channels = heads * dim
    data = bytes(chunk)
    if len(data) >= 2 and data[0] in (1, VERSION) and data[1] == MODE_EXPHUFF:
        if not heads * tokens * dim:
            raise DecodeError("ctxtans: an empty block's chunk holds data")
        return exphuff.decode(data[2:], dtype_name, shape)
    if len(data) < HEAD.size:
        raise DecodeError("ctxtans: truncated chunk")
    version, mode, flags, reserved, chunk_tag, base, n_escapes, stream_len = HEAD.unpack_from(data)
    if version not in (1, VERSION) or mode != MODE_DICT or flags & ~FLAG_REPEATS or reserved:
        raise DecodeError("ctxtans: not a chunk of this format")
    if chunk_tag != tag:
        raise DecodeError(f"ctxtans: the chunk was coded with dictionary {chunk_tag.hex()}..., not {tag.hex()}...")
    out = np.zeros((tokens, heads, dim), f"u{family.width}")
    if not heads * tokens * dim:
        if len(data) != HEAD.size or flags or base or n_escapes or stream_len:
            raise DecodeError("ctxtans: an empty block's chunk holds data")
        return np.moveaxis(out, 0, 1)
    ct = t.coder
    back, escape, raw, stream = read_sections(data, flags, shape, family, n_escapes, stream_len, "ctxtans", HEAD.size)
    tans = _TansDecoder(stream, t)
    # the models give no symbol of frequency 0: no class past N, no offset past 31
    classes, refs = read_channels(tans.next, channels, base, family, ct, escape, "ctxtans")
    context_of = ct.context_of.tolist()
    prev = [ct.start_context] * channels
    sign_shift, raw_bits, levels = 8 * family.width - 1, family.raw_bits, family.level_count
    raw_at = 0
    chan = coding_channels(np.array(classes, np.int64), dim, version).tolist()
    for g in range(0, channels, GROUP):
        for tok in range(tokens):
            for c in chan[g : g + GROUP]:
                h, d = divmod(c, dim)
                if back[tok, h]:
                    if back[tok, h] > tok:
                        raise DecodeError("ctxtans: a repeated row points before the block")
                    v = int(out[tok - back[tok, h], h, d])
                    out[tok, h, d] = v
                    q = (v >> raw_bits & levels - 1) - refs[c] - LOW + 1
                    prev[c] = context_of[(v >> sign_shift) * LEVELS + (q if 1 <= q < LEVELS else 0)]
                    continue
                s = tans.next(classes[c] * ct.contexts + prev[c])
                prev[c] = context_of[s]
                q = s % LEVELS
                lvl = escape() if q == 0 else refs[c] + LOW + q - 1
                if not 0 <= lvl < levels:
                    raise DecodeError("ctxtans: a level is out of range")
                out[tok, h, d] = (s // LEVELS) << sign_shift | lvl << raw_bits | raw[raw_at]
                raw_at += 1
    tans.finish()
    escape.finish()
    return np.moveaxis(out, 0, 1)
