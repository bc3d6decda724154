"""Rows that repeat an earlier row, and LEB128 varints: the repeat section that the context coders' chunks
(ctxans, ctxtans) and the ``int`` stage's coded codes plane share (docs/FORMAT.md, "Repeated rows").

A row (one token of one head) equal to an earlier row of its head is not coded again: a bitmap marks the
repeated rows and each one's distance back follows as a varint. numpy and the standard library only.
"""

from __future__ import annotations

import struct

import numpy as np

from kvtool.errors import DecodeError

#: The chunk flag that says a repeat section follows the header.
FLAG_REPEATS = 1


def repeated_rows(bits: np.ndarray) -> np.ndarray:
    """For each row ``[tokens, heads]``, how many tokens back its nearest earlier equal row of the head is (0: none)."""
    heads, tokens, _ = bits.shape
    back = np.zeros((tokens, heads), np.int64)
    for h in range(heads):
        last: dict[bytes, int] = {}
        for t in range(tokens):
            row = bits[h, t].tobytes()
            if row in last:
                back[t, h] = t - last[row]
            last[row] = t
    return back


def varint(value: int) -> bytes:
    """``value`` as an unsigned LEB128 varint (7 bits a byte, low first, the high bit set on all but the last)."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def repeat_section(back: np.ndarray, coded_rows: np.ndarray) -> tuple[int, bytes]:
    """The chunk's flags and repeat section: a bitmap of the repeated rows, then each one's distance."""
    if coded_rows.all():
        return 0, b""
    bitmap = np.packbits(~coded_rows.reshape(-1), bitorder="little").tobytes()
    body = bitmap + b"".join(varint(int(b) - 1) for b in back[~coded_rows])
    return FLAG_REPEATS, struct.pack("<I", len(body)) + body


def read_varint(data: bytes, at: int, max_bytes: int) -> tuple[int, int] | None:
    """The unsigned LEB128 varint at ``data[at]`` and the position after it; None where it runs past the end of
    ``data`` or past ``max_bytes`` bytes."""
    value = 0
    for n in range(max_bytes):
        if at + n >= len(data):
            return None
        byte = data[at + n]
        value |= (byte & 0x7F) << (7 * n)
        if not byte & 0x80:
            return value, at + n + 1
    return None


def read_repeats(body: bytes, tokens: int, heads: int, codec: str) -> np.ndarray:
    """The repeat section ``repeat_section`` writes: per (token, head) row the distance back to the row it
    repeats, 0 for a coded row."""
    rows = tokens * heads
    bitmap_len = (rows + 7) // 8
    if len(body) < bitmap_len:
        raise DecodeError(f"{codec}: truncated repeat section")
    flags = np.unpackbits(np.frombuffer(body, np.uint8, bitmap_len), bitorder="little")
    if flags[rows:].any():
        raise DecodeError(f"{codec}: bad repeat bitmap padding")
    back = np.zeros(rows, np.int64)
    at = bitmap_len
    for row in np.flatnonzero(flags[:rows]).tolist():
        read = read_varint(body, at, 5)
        if read is None:
            raise DecodeError(f"{codec}: bad repeat distance")
        value, at = read
        back[row] = value + 1
    if at != len(body):
        raise DecodeError(f"{codec}: the repeat section has trailing bytes")
    return back.reshape(tokens, heads)
