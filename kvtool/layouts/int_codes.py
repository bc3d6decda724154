"""``int:...,codes=ctx``: the ``int`` stage's codes coded with a context model of the previous token.

A code of an ``int`` block tends to be near the code of the same channel one
token before (keys are grouped per channel along tokens, so a channel's codes
drift slowly; values less so). This module codes a block's codes, ``count =
heads * tokens * dim`` codes of ``bits`` bits in C order of ``[heads, tokens,
dim]``, with per-chunk order-1 frequency tables and an interleaved rANS coder,
and falls back to the packed codes where coding would not be smaller. The codes
plane of ``codes=ctx`` is one byte longer than the packed plane, and holds:

``mode`` (u8)
    0: the packed codes follow (most significant bit first, as the ``packed``
    plane holds them). 1: coded, as below. The rest of the plane is zero.
``c`` (u8, mode 1)
    context bits, 0 to ``bits``: the context of the code at ``(h, t, d)`` is
    the code at ``(h, t - 1, d)`` shifted right by ``bits - c``, or for
    ``t = 0`` the start context ``2**c``; so there are ``2**c + 1`` contexts.
``model length``, ``stream length`` (u32 each, mode 1)
``repeats`` (mode 1)
    a u32 length, 0 where no row repeats, then the repeat section of the
    ctxans chunk: a bitmap of the ``tokens * heads`` rows in (token, head)
    order (bit ``i % 8`` of byte ``i // 8``), then for each repeated row its
    distance minus 1 as a LEB128 varint. A repeated row ``(h, t)`` is the row
    ``(h, t - distance)``, at most ``t`` back, and is not coded.
``model``
    a bitmap of the contexts that occur (bit ``k % 8`` of byte ``k // 8``),
    then per such context a bitmap of the ``2**bits`` symbols that occur in
    it, then those symbols' frequencies, out of ``2**12``, as LEB128 varints,
    all but the last (which is ``2**12`` less the others).
``stream``
    four u32 rANS states (32-bit states in ``[2**23, 2**31)``, byte-wise
    renormalisation, 12-bit frequencies); the code at position ``i`` of the
    block (C order) is coded with state ``i % 4``; the encoder runs from the
    last coded code to the first, and the bytes it emits follow the states
    in the order the decoder reads them. A decoder ends with every state at
    ``2**23`` and every byte read.

A repeated row is one equal to an earlier row of its head (the nearest is
named). The encoder counts each context's codes, normalises the counts (floor
of ``count * 4096 / total``, at least 1, the remainder added to the most
frequent code or taken from the largest frequencies, first ones first), and
picks ``c`` and whether to name repeats by the least estimated size (repeat
section, model bytes and the codes' fixed-point ``-log2`` cost; ties go to no
repeats, then the smaller ``c``), then codes only where the result is shorter
than mode 0. All of it is integer arithmetic, so the C core
(intcodes.c) writes the same bytes; this module is the reference.
"""

from __future__ import annotations

import functools

import numpy as np

from kvtool import _native
from kvtool.errors import DecodeError, UsageError
from kvtool.repeats import read_repeats, read_varint, repeat_section, repeated_rows, varint

PROB_BITS = 12
TOTAL = 1 << PROB_BITS
LOW = 1 << 23  # the least rANS state
STATES = 4
HEADER = 14  # mode, context bits, model length, stream length, repeat section length
#: The reasons the C core gives a plane it refuses (its status), in the reference's words.
REASONS = {
    1: "unknown mode",
    2: "lengths beyond the plane",
    3: "a malformed model",
    4: "a malformed stream",
    5: "bytes after its end",
    6: "a malformed repeat section",
}


def plane_size(count: int, widest: int) -> int:
    """The codes plane's bytes for ``count`` codes: the mode byte and room for the packed codes of the widest width."""
    return 1 + -(-count * widest // 8)


def encode(packed: np.ndarray, shape: tuple[int, ...], bits: int, size: int) -> np.ndarray:
    """The codes plane (``size`` bytes) of a block's packed codes (``ceil(count * bits / 8)`` bytes or more)."""
    core = _native.core()
    count = int(np.prod(shape))
    used = -(-count * bits // 8)
    packed = np.ascontiguousarray(packed[:used])
    if core is not None:
        plane = np.zeros(size, np.uint8)
        heads, tokens, dim = shape
        if core.int_codes_encode(packed, plane, heads, tokens, dim, bits) == 0:
            return plane
    return reference_encode(packed, shape, bits, size)


def decode(plane: np.ndarray, shape: tuple[int, ...], bits: int) -> np.ndarray:
    """The packed codes (``ceil(count * bits / 8)`` bytes) a codes plane holds; ``DecodeError`` where it is damaged."""
    core = _native.core()
    if core is None:
        return reference_decode(plane, shape, bits)
    packed = np.zeros(-(-int(np.prod(shape)) * bits // 8), np.uint8)
    heads, tokens, dim = shape
    status = core.int_codes_decode(np.ascontiguousarray(plane), packed, heads, tokens, dim, bits)
    if status:
        raise DecodeError(f"int codes plane: {REASONS.get(status, f'status {status}')}")
    return packed


# -- the reference -------------------------------------------------------------------------------


def reference_encode(packed: np.ndarray, shape: tuple[int, ...], bits: int, size: int) -> np.ndarray:
    heads, tokens, dim = shape
    count = heads * tokens * dim
    used = -(-count * bits // 8)
    if not 1 <= bits <= 8 or size < 1 + used or packed.size < used:
        raise UsageError(f"int codes: {count} codes of {bits} bits do not fit a plane of {size} bytes")
    plane = np.zeros(size, np.uint8)
    plane[1 : 1 + used] = packed[:used]
    if count == 0:
        return plane
    codes = unpack(packed, count, bits).reshape(shape).astype(np.int64)
    back = repeated_rows(codes.astype(np.uint8))  # [tokens, heads]
    options = [(np.ones_like(back, bool), b"\0\0\0\0")]  # (the rows coded, the repeat section)
    if back.any():
        options.append((back == 0, repeat_section(back, back == 0)[1]))
    candidates = []
    for coded_rows, section in options:
        counts = _counts(codes, bits, coded_rows.T)  # [contexts (full), symbols]
        for c in range(bits + 1):
            cost, model, freqs = _candidate(counts, bits, c)
            candidates.append((cost + (len(section) * 8 << 16), c, freqs, model, coded_rows, section))
    # the least estimated size; min keeps the first of equal ones: no repeats, then the smallest c
    _, c, freqs, model, coded_rows, section = min(candidates, key=lambda candidate: candidate[0])
    stream = _rans_encode(codes, bits, c, freqs, coded_rows.T)
    if 10 + len(section) + len(model) + len(stream) < 1 + used:
        plane[:] = 0
        header = bytes([1, c]) + len(model).to_bytes(4, "little") + len(stream).to_bytes(4, "little")
        coded = np.frombuffer(header + section + model + stream, np.uint8)
        plane[: coded.size] = coded
    return plane


def reference_decode(plane: np.ndarray, shape: tuple[int, ...], bits: int) -> np.ndarray:
    heads, tokens, dim = shape
    count = heads * tokens * dim
    used = -(-count * bits // 8)
    data = bytes(np.ascontiguousarray(plane).reshape(-1).view(np.uint8))
    if not data or data[0] > 1:
        raise DecodeError(f"int codes plane: {REASONS[1]}")
    if data[0] == 0:
        if len(data) < 1 + used:
            raise DecodeError(f"int codes plane: {REASONS[2]}")
        end = 1 + used
        packed: np.ndarray = np.frombuffer(data, np.uint8, used, 1).copy()
        if used and bits * count % 8 and packed[-1] & (0xFF >> (bits * count % 8)):
            raise DecodeError(f"int codes plane: {REASONS[5]}")  # bits past the last code
    else:
        if len(data) < HEADER:
            raise DecodeError(f"int codes plane: {REASONS[2]}")
        c = data[1]
        model_len, stream_len, section_len = (int.from_bytes(data[at : at + 4], "little") for at in (2, 6, 10))
        model_at = HEADER + section_len
        end = model_at + model_len + stream_len
        if c > bits or end > len(data):
            raise DecodeError(f"int codes plane: {REASONS[2] if c <= bits else REASONS[3]}")
        back = np.zeros((tokens, heads), np.int64)
        if section_len:
            try:
                back = read_repeats(data[HEADER:model_at], tokens, heads, "repeats")
            except DecodeError as exc:
                raise DecodeError(f"int codes plane: {REASONS[6]} ({exc})") from None
            if (back > np.arange(tokens)[:, None]).any():
                raise DecodeError(f"int codes plane: {REASONS[6]} (a row repeats one before the block)")
        freqs = _read_model(data[model_at : model_at + model_len], bits, c)
        codes = _rans_decode(data[model_at + model_len : end], shape, bits, c, freqs, back.T.tolist())
        packed = pack(codes, bits)
    if any(data[end:]):
        raise DecodeError(f"int codes plane: {REASONS[5]}")
    return packed


def unpack(packed: np.ndarray, count: int, bits: int) -> np.ndarray:
    """``count`` codes of ``bits`` bits from a stream packed most significant bit first."""
    stream = np.unpackbits(np.asarray(packed, np.uint8)[: -(-count * bits // 8)])[: count * bits]
    weights = (1 << np.arange(bits - 1, -1, -1)).astype(np.uint16)
    return (stream.reshape(count, bits) @ weights).astype(np.uint8)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of ``unpack``: codes below ``2**bits``, most significant bit first, zero padded."""
    flat = np.asarray(codes, np.uint8).reshape(-1, 1)
    return np.packbits(np.unpackbits(flat, axis=1)[:, 8 - bits :].reshape(-1))


def _contexts(codes: np.ndarray, bits: int, c: int) -> np.ndarray:
    """Each code's context (``[heads, tokens, dim]``): the previous token's code shifted, or ``2**c`` at token 0."""
    ctx = np.empty_like(codes)
    ctx[:, 0] = 1 << c
    ctx[:, 1:] = codes[:, :-1] >> (bits - c)
    return ctx


def _counts(codes: np.ndarray, bits: int, coded_rows: np.ndarray) -> np.ndarray:
    """``[contexts, symbols]`` counts of the codes in the rows coded (``[heads, tokens]``), full contexts."""
    symbols = 1 << bits
    index = (_contexts(codes, bits, bits) * symbols + codes)[coded_rows]
    return np.bincount(index.reshape(-1), minlength=(symbols + 1) * symbols).reshape(symbols + 1, symbols)


def _merged(counts: np.ndarray, bits: int, c: int) -> np.ndarray:
    """The full contexts' counts summed into ``2**c + 1`` contexts (the start context last)."""
    symbols = 1 << bits
    body = counts[:symbols].reshape(1 << c, symbols >> c, symbols).sum(axis=1)
    return np.concatenate([body, counts[symbols:]])


def _candidate(counts: np.ndarray, bits: int, c: int) -> tuple[int, bytes, list[list[int] | None]]:
    """``(estimated size in 2**-16 bits, model, frequencies)`` of context bits ``c``."""
    merged = _merged(counts, bits, c)
    freqs = [_normalise(row) for row in merged]
    model = _model(freqs, bits)
    table = np.array([row or [0] * (1 << bits) for row in freqs], np.int64)
    cost = int((merged.astype(np.int64) * np.array(_costs(), np.int64)[table]).sum())
    return cost + (len(model) * 8 << 16), model, freqs


def _normalise(row: np.ndarray) -> list[int] | None:
    """Counts as frequencies summing to ``TOTAL``; None for a context that never occurs."""
    total = int(row.sum())
    if total == 0:
        return None
    counts = [int(n) for n in row]
    freqs = [max(1, n * TOTAL // total) if n else 0 for n in counts]
    spare = TOTAL - sum(freqs)
    if spare > 0:
        freqs[counts.index(max(counts))] += spare
    while spare < 0:
        j = freqs.index(max(freqs))
        take = min(-spare, freqs[j] - 1)
        freqs[j] -= take
        spare += take
    return freqs


def _model(freqs: list[list[int] | None], bits: int) -> bytes:
    present = bytearray(-(-len(freqs) // 8))
    body = bytearray()
    for k, row in enumerate(freqs):
        if row is None:
            continue
        present[k // 8] |= 1 << (k % 8)
        symbols = bytearray(-(-(1 << bits) // 8))
        for s, f in enumerate(row):
            if f:
                symbols[s // 8] |= 1 << (s % 8)
        body += symbols
        for f in [f for f in row if f][:-1]:
            body += varint(f)
    return bytes(present + body)


def _read_model(model: bytes, bits: int, c: int) -> list[list[int] | None]:
    """The model's frequencies per context; ``DecodeError`` unless it is exactly what ``_model`` writes."""
    bad = DecodeError(f"int codes plane: {REASONS[3]}")
    contexts, symbols = (1 << c) + 1, 1 << bits
    at = -(-contexts // 8)
    if len(model) < at or int.from_bytes(model[:at], "little") >> contexts:
        raise bad
    freqs: list[list[int] | None] = []
    for k in range(contexts):
        if not model[k // 8] >> (k % 8) & 1:
            freqs.append(None)
            continue
        width = -(-symbols // 8)
        if at + width > len(model):
            raise bad
        mask = int.from_bytes(model[at : at + width], "little")
        at += width
        if mask == 0 or mask >> symbols:
            raise bad
        present = [s for s in range(symbols) if mask >> s & 1]
        row = [0] * symbols
        for s in present[:-1]:
            read = read_varint(model, at, 2)
            if read is None:
                raise bad
            f, end = read
            if end - at > 1 and model[end - 1] == 0 or not 1 <= f < TOTAL:  # a needless zero byte, or out of range
                raise bad
            row[s], at = f, end
        last = TOTAL - sum(row)
        if last < 1:
            raise bad
        row[present[-1]] = last
        freqs.append(row)
    if at != len(model):
        raise bad
    return freqs


def _starts(row: list[int]) -> list[int]:
    out, at = [], 0
    for f in row:
        out.append(at)
        at += f
    return out


def _rans_encode(codes: np.ndarray, bits: int, c: int, freqs: list[list[int] | None], coded_rows: np.ndarray) -> bytes:
    """The stream of the codes in the rows coded (``[heads, tokens]``); code ``i`` (in the block) takes state ``i % 4``."""
    symbols = 1 << bits
    table_f = np.zeros(len(freqs) * symbols, np.int64)
    table_c = np.zeros_like(table_f)
    for k, row in enumerate(freqs):
        if row is not None:
            table_f[k * symbols : (k + 1) * symbols] = row
            table_c[k * symbols : (k + 1) * symbols] = _starts(row)
    positions = np.flatnonzero(np.broadcast_to(coded_rows[:, :, None], codes.shape))
    index = (_contexts(codes, bits, c) * symbols + codes).reshape(-1)[positions]
    fs, cs = table_f[index].tolist(), table_c[index].tolist()
    states = [LOW] * STATES
    out = bytearray()
    for i, f, start in zip(reversed(positions.tolist()), reversed(fs), reversed(cs)):
        j = i & (STATES - 1)
        x = states[j]
        top = f << (31 - PROB_BITS)
        while x >= top:
            out.append(x & 0xFF)
            x >>= 8
        states[j] = ((x // f) << PROB_BITS) + x % f + start
    out.reverse()
    return b"".join(x.to_bytes(4, "little") for x in states) + bytes(out)


def _rans_decode(stream: bytes, shape: tuple[int, ...], bits: int, c: int, freqs: list[list[int] | None],
                 back: list[list[int]]) -> np.ndarray:
    """The codes; a row ``(h, t)`` with ``back[h][t]`` set is the row that many tokens before, not coded."""
    bad = DecodeError(f"int codes plane: {REASONS[4]}")
    heads, tokens, dim = shape
    if len(stream) < 4 * STATES:
        raise bad
    states = [int.from_bytes(stream[4 * j : 4 * j + 4], "little") for j in range(STATES)]
    if not all(LOW <= x < LOW << 8 for x in states):
        raise bad
    slots: list[list[int] | None] = []
    starts: list[list[int] | None] = []
    for row in freqs:
        slots.append(None if row is None else [s for s, f in enumerate(row) for _ in range(f)])
        starts.append(None if row is None else _starts(row))
    shift, start_ctx, mask = bits - c, 1 << c, TOTAL - 1
    out = [0] * (heads * tokens * dim)
    at, i = 4 * STATES, 0
    for h in range(heads):
        for t in range(tokens):
            if back[h][t]:
                out[i : i + dim] = out[i - back[h][t] * dim : i - back[h][t] * dim + dim]
                i += dim
                continue
            for _ in range(dim):
                k = start_ctx if t == 0 else out[i - dim] >> shift
                row, table = freqs[k], slots[k]
                if row is None or table is None:
                    raise bad
                j = i & (STATES - 1)
                x = states[j]
                slot = x & mask
                s = table[slot]
                x = row[s] * (x >> PROB_BITS) + slot - starts[k][s]  # type: ignore[index]
                while x < LOW:
                    if at >= len(stream):
                        raise bad
                    x = x << 8 | stream[at]
                    at += 1
                states[j] = x
                out[i] = s
                i += 1
    if at != len(stream) or any(x != LOW for x in states):
        raise bad
    return np.array(out, np.uint8)


@functools.lru_cache(maxsize=1)
def _costs() -> tuple[int, ...]:
    """``-log2(f / 4096)`` in 16-bit fixed point for f in 0..4096 (0 unused), by integer squaring (C does the same)."""
    return (0, *((PROB_BITS << 16) - _log2_fixed(f) for f in range(1, TOTAL + 1)))


def _log2_fixed(f: int) -> int:
    """``floor(log2(f) * 2**16)``, digit by digit: square the mantissa (Q30 in [1, 2)), a carry past 2 is a 1 bit."""
    whole = f.bit_length() - 1
    x = f << (30 - whole)
    frac = 0
    for b in range(15, -1, -1):
        x = (x * x) >> 30
        if x >= 1 << 31:
            x >>= 1
            frac |= 1 << b
    return (whole << 16) | frac
