"""The exphuff-lanes chunk format (exphuff version 2) in numpy: the reference C and Triton must match.

Version 1 codes a block's symbols in four bit streams: a CPU core decodes them
side by side, a GPU cannot (a few streams are a few threads). Version 2 deals
the symbols round-robin to ``K = ceil(N / L)`` *lane streams* (symbol ``i`` to
lane ``i % K``), each a plain LSB-first bit stream whose byte length is in a
table: thousands of lanes decode at once, each lane's step ``j`` writing symbol
``j * K + lane``, so neighbouring lanes write neighbouring values. The code
table, the channel references and the raw plane are those of version 1, so the
ratio differs only by the lane table (two bytes per lane) and each lane's
last partial byte. docs/FORMAT.md specifies it.

The decoder here runs every lane in lock step, one numpy step per symbol of the
longest lane, the way the GPU kernel does.
"""

from __future__ import annotations

import numpy as np

from kvtool._native.reference import (
    FAMILIES, MAXBITS, MODE_CODED, MODE_ONE_SYMBOL, ChunkFrame, canonical_codes, huffman_lengths, read_code_table,
    split_symbols, write_code_table,
)
from kvtool.errors import DecodeError

VERSION = 2
MIN_LANE, MAX_LANE = 16, 16384  # symbols per lane; a lane's bytes then fit a u16 (16384 x 10 / 8 < 2^16)
DEFAULT_LANE = 512


def lane_count(n: int, lane: int) -> int:
    """Lane streams of a chunk of ``n`` symbols at ``lane`` symbols per lane."""
    return -(-n // lane)


def _pack_lanes(sym: np.ndarray, k: int, codes: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, bytes]:
    """Byte lengths of the ``k`` lane streams, and the streams back to back."""
    n = sym.size
    lane_of = np.arange(n) % k
    order = np.argsort(lane_of, kind="stable")  # symbols lane by lane, each lane in order
    lens = length[sym[order]].astype(np.int64)
    lane_bits = np.bincount(lane_of, weights=length[sym].astype(np.int64), minlength=k).astype(np.int64)
    lane_bytes = (lane_bits + 7) // 8
    lane_start = 8 * (np.cumsum(lane_bytes) - lane_bytes)
    within = np.cumsum(lens) - lens - np.repeat(np.cumsum(lane_bits) - lane_bits, np.bincount(lane_of, minlength=k))
    first_bit = lane_start[lane_of[order]] + within
    total = int(lane_bytes.sum()) * 8
    owner = np.repeat(np.arange(n), lens)
    offset = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    bits = np.zeros(total, np.uint8)
    bits[first_bit[owner] + offset] = (codes[sym[order]][owner] >> offset.astype(np.uint32)) & 1
    return lane_bytes, np.packbits(bits, bitorder="little").tobytes()


def encode(block: np.ndarray, dtype_name: str, lane: int = DEFAULT_LANE) -> bytes:
    """The exphuff-lanes chunk of a block ``[heads, tokens, dim]`` (any strides)."""
    if not MIN_LANE <= lane <= MAX_LANE:
        raise ValueError(f"lane must be {MIN_LANE}..{MAX_LANE} symbols")
    family = FAMILIES[dtype_name]
    refs, raw, sym = split_symbols(block, family)
    length = huffman_lengths(np.bincount(sym, minlength=256))
    head = bytes([VERSION])
    body = refs.tobytes() + raw.tobytes()
    if np.count_nonzero(length) <= 1:
        return head + bytes([MODE_ONE_SYMBOL]) + body + bytes([int(sym[0]) if sym.size else 0])
    k = lane_count(sym.size, lane)
    lane_bytes, streams = _pack_lanes(sym, k, canonical_codes(length), length)
    return (head + bytes([MODE_CODED]) + body + np.array([lane], "<u2").tobytes() + write_code_table(length)
            + lane_bytes.astype("<u2").tobytes() + streams)


def decode(chunk: bytes | memoryview, dtype_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The block an exphuff-lanes chunk holds, as unsigned integers of the dtype's width; ``DecodeError`` if malformed."""
    frame = ChunkFrame.read(chunk, dtype_name, shape, VERSION, "exphuff-lanes")
    sym = frame.one_symbol_run() if frame.one_symbol else _decode_lanes(frame.data, frame.fixed, frame.n)
    return frame.values(sym)


def _decode_lanes(data: bytes, at: int, n: int) -> np.ndarray:
    if len(data) < at + 2:
        raise DecodeError("exphuff-lanes: truncated lane header")
    lane = int.from_bytes(data[at : at + 2], "little")
    if not MIN_LANE <= lane <= MAX_LANE:
        raise DecodeError("exphuff-lanes: symbols per lane out of range")
    length, at = read_code_table(data, at + 2, "exphuff-lanes")
    k = lane_count(n, lane)
    if len(data) < at + 2 * k:
        raise DecodeError("exphuff-lanes: truncated lane table")
    lane_bytes = np.frombuffer(data, "<u2", k, at).astype(np.int64)
    at += 2 * k
    if int(lane_bytes.sum()) != len(data) - at:
        raise DecodeError("exphuff-lanes: lane lengths do not add up to the chunk")
    stream = np.frombuffer(data, np.uint8, len(data) - at, at)
    table_sym, table_len = decode_table(length)
    begin = 8 * (np.cumsum(lane_bytes) - lane_bytes)
    end = begin + 8 * lane_bytes
    pos = begin.copy()
    lanes = np.arange(k)
    out = np.empty(n, np.uint8)
    padded = np.concatenate([stream, np.zeros(3, np.uint8)]).astype(np.int64)
    steps = -(-n // k)
    for step in range(steps):
        live = lanes[step * k + lanes < n]
        p = pos[live]
        byte = np.minimum(p >> 3, len(stream))
        # A code never depends on the bits after it, so a window may run into the next lane (or
        # zeros past the last): only a lane that ends past its own bytes is wrong, checked below.
        slot = ((padded[byte] | padded[byte + 1] << 8 | padded[byte + 2] << 16) >> (p & 7)) & ((1 << MAXBITS) - 1)
        out[step * k + live] = table_sym[slot]
        pos[live] = p + table_len[slot]
    if np.any(pos > end) or np.any(end - pos >= 8):
        raise DecodeError("exphuff-lanes: a lane's length does not match its symbols")
    return out


def decode_table(length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symbol and code length for every MAXBITS-bit window (LSB first): the table every decoder looks up."""
    codes = canonical_codes(length)
    table_sym = np.zeros(1 << MAXBITS, np.uint8)
    table_len = np.zeros(1 << MAXBITS, np.int64)
    for s in np.flatnonzero(length):
        step = 1 << int(length[s])
        table_sym[int(codes[s]) :: step] = s
        table_len[int(codes[s]) :: step] = length[s]
    return table_sym, table_len
