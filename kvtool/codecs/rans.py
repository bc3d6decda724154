"""``rans``: 16-bit symbols entropy-coded row by row, one order-0 model per row (extra ``kvtool[rans]``).

Built for the ``sx`` plane of ``channel-major|sx-split``: a plane ``[heads,
dim, tokens]`` is ``heads * dim`` rows, one per channel, and each channel's
(exponent, sign change) symbols have a distribution of their own. ``rans:ROWS``
cuts the input into ``ROWS`` rows and codes each with a model built from that
row's symbol counts; the models travel in the stream, rounded to weights with a
leading binary digit and one more (``2**e`` or ``1.5 * 2**e``), which costs
little in coding and halves what the models take. The entropy coder is
``constriction``'s range ANS coder (``AnsCoder``: 32-bit words, 64-bit state,
24-bit fixed-point probabilities, ``Categorical(..., perfect=False)`` models).

Wire format (integers little-endian; varints are unsigned LEB128)::

    magic      4 bytes  b"KVAN"
    mode       u8       0: stored, 1: coded
    length     u64      n, bytes of the input
    checksum   u64      XXH3-64 (seed 0) of the input
    mode 0:    the n input bytes
    mode 1:
      rows        u32   R, 1 <= R <= max(1, n // 2): the codec's rows, fewer when there are fewer symbols
      model len   u32   bytes of the model section
      model       varints, all in one run:
                    low, the smallest symbol; K, the largest minus low plus 1;
                    R firsts: each row's smallest symbol minus low;
                    R spans: each row's largest symbol minus its smallest plus 1 (0 for an empty row);
                    C >= 2, then C counts: how often each weight code 0..C-1 occurs
      tail        n % 2 bytes: the last input byte when n is odd, as is
      words       u32 count W, then W u32 words: the coder's compressed stack

The first ``n // 2 * 2`` input bytes are ``m = n // 2`` little-endian u16
symbols; row ``r`` holds symbols ``r * L`` up to ``min((r + 1) * L, m)``,
``L = ceil(m / R)`` (trailing rows may be empty). Popped from the stack in this
order: first the weight codes of every row's span, row by row (one code per
symbol from ``low + first`` to ``low + first + span - 1``), coded with the model
``Categorical(C counts)``; code ``c`` means weight 0 when ``c == 0``, else
``((2 + (c - 1) % 2) << ((c - 1) // 2)) >> 1``. Then, for each row with a span
over 1, its symbols in order as ``symbol - low - first``, coded with
``Categorical(its span's weights)``; a row with a span of 1 holds one symbol,
repeated, and takes no coded bits. The encoder falls back to mode 0 when
coding would not pay.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

from kvtool.codecs.base import Availability, BufferLike, Codec, as_memoryview, check_output_size
from kvtool.errors import DecodeError, UnavailableError, UsageError

try:
    import constriction
except ImportError:  # the codec stays listed and says how to get it
    constriction = None

MAGIC = b"KVAN"
HEAD = struct.Struct("<4sBQQ")
CODED_HEAD = struct.Struct("<II")
STORED, CODED = 0, 1
MAX_ROWS = 1 << 24
#: Above this many model entries per symbol the counts would cost more than they save.
MAX_MODEL_PER_SYMBOL = 2
#: Weight codes stand for weights up to ``3 * 2**46``, far above any count a stream can hold.
MAX_WEIGHT_CODES = 96
#: No value in a valid model reaches this (counts of weight codes are at most rows * 2**16 <= 2**40).
MAX_MODEL_VALUE = 1 << 48


class RansCodec(Codec):
    codec_id = "rans"
    params = ("rows",)
    spec_param = "rows"
    magic = MAGIC

    def __init__(self, rows: int = 1):
        if isinstance(rows, bool) or not 1 <= int(rows) <= MAX_ROWS:
            raise UsageError(f"rans rows must be in 1..{MAX_ROWS}, not {rows!r}")
        self.rows = int(rows)

    @classmethod
    def available(cls) -> Availability:
        if constriction is None:
            return Availability(False, reason="needs constriction: pip install 'kvtool[rans]'")
        return Availability(True, implementation="constriction range ANS")

    def encode(self, buf: BufferLike) -> bytes:
        if constriction is None:
            raise UnavailableError("codec 'rans' needs constriction: pip install 'kvtool[rans]'")
        view = as_memoryview(buf)
        head = (len(view), xxhash.xxh3_64_intdigest(view))
        coded = _encode_rows(np.frombuffer(view, np.uint8), self.rows)
        if coded is None or len(coded) >= len(view):
            return HEAD.pack(MAGIC, STORED, *head) + bytes(view)
        return HEAD.pack(MAGIC, CODED, *head) + coded

    def decode(self, buf: BufferLike, max_size: int) -> bytes:
        view = as_memoryview(buf)
        if len(view) < HEAD.size:
            raise DecodeError("truncated rans stream")
        magic, mode, length, checksum = HEAD.unpack_from(view)
        if magic != MAGIC or mode not in (STORED, CODED):
            raise DecodeError("not a rans stream")
        check_output_size(length, max_size)
        body = view[HEAD.size :]
        if mode == STORED:
            if len(body) != length:
                raise DecodeError(f"stored rans stream holds {len(body)} bytes, its header says {length}")
            out = bytes(body)
        else:
            if constriction is None:
                raise UnavailableError("codec 'rans' needs constriction to decode: pip install 'kvtool[rans]'")
            out = _decode_rows(body, length)
        if xxhash.xxh3_64_intdigest(out) != checksum:
            raise DecodeError("rans stream checksum mismatch (corrupt data)")
        return out


# -- coding -----------------------------------------------------------------------------------


def _row_bounds(symbols: int, rows: int) -> np.ndarray:
    """Start of each row and the end of the last, ``rows + 1`` offsets."""
    length = -(-symbols // rows)
    return np.minimum(np.arange(rows + 1, dtype=np.int64) * length, symbols)


def _row_parts(symbols: np.ndarray, bounds: np.ndarray):
    """The rows as at most two 2-D blocks ``(symbols [rows, length], row numbers)``: the full rows, then the short last one."""
    length = int(bounds[1] - bounds[0]) if len(bounds) > 1 else 0
    full = len(symbols) // length if length else 0
    if full:
        yield symbols[: full * length].reshape(full, length), np.arange(full)
    if len(symbols) > full * length:
        yield symbols[full * length :].reshape(1, -1), np.array([full])


def weight_code(counts: np.ndarray) -> np.ndarray:
    """The code of the weight nearest each count: 0 for 0, else ``2 * e + m + 1`` for ``(2 + m) * 2**e / 2``."""
    counts = np.asarray(counts, np.int64)
    code = np.zeros(counts.shape, np.int64)
    nonzero = counts > 0
    exponent = np.floor(np.log2(counts[nonzero])).astype(np.int64)
    mantissa = np.rint(2 * counts[nonzero] / np.exp2(exponent)).astype(np.int64) - 2
    exponent += mantissa == 2
    mantissa[mantissa == 2] = 0
    code[nonzero] = 2 * exponent + mantissa + 1
    return code


def weight_of(code: np.ndarray) -> np.ndarray:
    """The weight a code stands for, in exact integer arithmetic."""
    code = np.asarray(code, np.int64)
    step = np.maximum(code - 1, 0)
    return np.where(code > 0, ((2 + (step & 1)) << (step >> 1)) >> 1, 0)


def _encode_rows(data: np.ndarray, rows: int) -> bytes | None:
    symbols = data[: len(data) // 2 * 2].view("<u2")
    rows = min(rows, max(len(symbols), 1))  # rows past the last symbol would be empty
    bounds = _row_bounds(len(symbols), rows)
    lengths = np.diff(bounds)
    low = int(symbols.min()) if len(symbols) else 0
    k = int(symbols.max()) - low + 1 if len(symbols) else 0
    if rows * k > MAX_MODEL_PER_SYMBOL * len(symbols) + (1 << 16):
        return None
    counts: np.ndarray = np.zeros(rows * k, np.int64)
    for part, row in _row_parts(symbols, bounds):  # one bincount over row-offset symbols
        counts += np.bincount((part + (row * k - low)[:, None]).reshape(-1), minlength=rows * k)
    counts = counts.reshape(rows, k)
    used = np.concatenate([counts > 0, np.ones((rows, 1), bool)], axis=1)  # a sentinel for empty rows
    filled = lengths > 0
    first = np.where(filled, np.argmax(used, axis=1), 0)
    span = np.where(filled, k - np.argmax(used[:, -2::-1], axis=1) - first, 0) if k else np.zeros(rows, np.int64)
    columns = np.arange(k)
    in_span = (columns >= first[:, None]) & (columns < (first + span)[:, None])
    codes = weight_code(counts[in_span])
    weights = weight_of(codes).astype(np.float64)
    code_counts = np.bincount(codes, minlength=2)
    model = _varints(np.concatenate([[low, k], first, span, [len(code_counts)], code_counts]))

    coder = constriction.stream.stack.AnsCoder()
    family = constriction.stream.model.Categorical
    model_start = np.concatenate([[0], np.cumsum(span)])
    coded = span > 1
    for part, row in reversed(list(_row_parts(symbols, bounds))):
        keep = coded[row]
        row = row[keep]
        part = part[keep] - (first[row] + low).astype(np.int32)[:, None]
        for r, symbols_of_row in zip(row[::-1], part[::-1]):
            coder.encode_reverse(symbols_of_row, family(weights[model_start[r] : model_start[r + 1]], perfect=False))
    if len(codes):
        coder.encode_reverse(codes.astype(np.int32), family(code_counts.astype(np.float64), perfect=False))
    words = coder.get_compressed().astype("<u4")
    tail = data[len(symbols) * 2 :].tobytes()
    return b"".join(
        [CODED_HEAD.pack(rows, len(model)), model, tail, struct.pack("<I", len(words)), words.tobytes()]
    )


def _decode_rows(body: memoryview, length: int) -> bytes:
    if len(body) < CODED_HEAD.size:
        raise DecodeError("truncated rans stream")
    rows, model_len = CODED_HEAD.unpack_from(body)
    pos = CODED_HEAD.size
    m = length // 2
    if not 1 <= rows <= max(m, 1) or pos + model_len > len(body):
        raise DecodeError("rans stream: bad row count or model length")
    values = _read_varints(np.frombuffer(body[pos : pos + model_len], np.uint8))
    pos += model_len
    bounds = _row_bounds(m, rows)
    lengths = np.diff(bounds)
    low, first, span, code_counts = _split_model(values, rows)
    if np.any((span == 0) & (lengths > 0)):
        raise DecodeError("rans stream: a row with symbols has no model")
    tail = bytes(body[pos : pos + length % 2])
    pos += length % 2
    if pos + 4 > len(body):
        raise DecodeError("truncated rans stream")
    (n_words,) = struct.unpack_from("<I", body, pos)
    pos += 4
    if pos + 4 * n_words != len(body):
        raise DecodeError("rans stream: the coded words do not fill the stream")
    words = np.frombuffer(body[pos:], "<u4").astype(np.uint32)

    index = np.repeat(first, lengths)
    family = constriction.stream.model.Categorical
    model_start = np.concatenate([[0], np.cumsum(span)])
    try:
        coder = constriction.stream.stack.AnsCoder(words)
        codes = coder.decode(family(code_counts.astype(np.float64), perfect=False), int(model_start[-1]))
        weights = weight_of(codes).astype(np.float64)
        for r in np.flatnonzero(span > 1):
            row_weights = weights[model_start[r] : model_start[r + 1]]
            index[bounds[r] : bounds[r + 1]] += coder.decode(family(row_weights, perfect=False), int(lengths[r]))
        leftover = not coder.is_empty()
    except (ValueError, RuntimeError, OverflowError) as exc:
        raise DecodeError(f"corrupt rans data: {exc}") from None
    if leftover:
        raise DecodeError("corrupt rans data: coded words left over")
    index += low
    if len(index) and index.max() >= 1 << 16:
        raise DecodeError("corrupt rans data: symbol beyond 16 bits")
    return index.astype("<u2").tobytes() + tail


def _split_model(values: np.ndarray, rows: int) -> tuple:
    """Lowest symbol, row firsts, row spans and weight-code counts from the model's varints, checked."""
    if len(values) < 3 + 2 * rows or values.max() > MAX_MODEL_VALUE:
        raise DecodeError("rans stream: truncated model")
    low, k = int(values[0]), int(values[1])
    if low + k > 1 << 16:
        raise DecodeError("rans stream: symbols beyond 16 bits")
    first = values[2 : 2 + rows]
    span = values[2 + rows : 2 + 2 * rows]
    n_codes = int(values[2 + 2 * rows])
    code_counts = values[3 + 2 * rows :]
    if not 2 <= n_codes <= MAX_WEIGHT_CODES or len(code_counts) != n_codes:
        raise DecodeError("rans stream: bad weight-code table")
    if np.any(first + span > k) or code_counts.sum() != span.sum():
        raise DecodeError("rans stream: a row's model does not fit the symbol range")
    return low, first, span, code_counts


# -- varints ----------------------------------------------------------------------------------


def _varints(values: np.ndarray) -> bytes:
    """Unsigned LEB128 of non-negative integers below 2**63, vectorised."""
    values = np.asarray(values, np.uint64)
    if not len(values):
        return b""
    widths = np.ones(len(values), np.int64)
    for shift in range(7, 64, 7):
        widths += values >= np.uint64(1 << shift)
    ends = np.cumsum(widths)
    position = np.arange(ends[-1]) - np.repeat(ends - widths, widths)
    out = (np.repeat(values, widths) >> (7 * position).astype(np.uint64)) & np.uint64(0x7F)
    out |= (position < np.repeat(widths, widths) - 1).astype(np.uint64) << np.uint64(7)
    return out.astype(np.uint8).tobytes()


def _read_varints(data: np.ndarray) -> np.ndarray:
    if not len(data):
        return np.zeros(0, np.int64)
    ends = np.flatnonzero(data < 0x80)
    if not len(ends) or ends[-1] != len(data) - 1:
        raise DecodeError("rans stream: truncated varint")
    starts = np.concatenate([[0], ends[:-1] + 1])
    if np.any(ends - starts > 8):
        raise DecodeError("rans stream: varint too long")
    position = np.arange(len(data)) - np.repeat(starts, ends - starts + 1)
    parts = (data & 0x7F).astype(np.int64) << (7 * position)
    return np.add.reduceat(parts, starts)
