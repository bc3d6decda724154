"""Triton kernels of the exphuff-lanes format (exphuff chunk version 2, docs/FORMAT.md).

Two kernels per batch of chunks bound for one destination tensor:

- ``code_table_kernel`` (one program per chunk) reads the chunk's header,
  checks it as the C core does, builds the chunk's decode table (1024 slots of
  symbol | length << 8, 4 KiB: L1 or shared memory sized) and every lane's
  first bit (a running sum over the lane table);
- ``decode_kernel`` (one program per ``LANES`` lanes of a chunk) walks its
  lanes in lock step: lane ``k`` at step ``j`` decodes symbol ``j * K + k``,
  adds the channel's reference, joins the raw sign and mantissa bits and writes
  the value straight to its row in the destination (``rows``: the element
  offset of each (head, token) row from ``row_base``, -1 for a row left out), so neighbouring
  lanes write neighbouring values of a row.

A malformed chunk sets its status word (``STATUS_*``) and its values are not
written; every load is bounded by the chunk's own bytes, whatever the chunk
says. A chunk the container stored raw (its values as they are) is copied to
its rows by the same decode kernel. The kernels run on a GPU, or on CPU tensors under ``TRITON_INTERPRET=1``,
where the tests check them against the numpy reference bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAXBITS = 10
TABLE_SLOTS = 1 << MAXBITS
STATUS_OK, STATUS_HEADER, STATUS_TABLE, STATUS_LANES, STATUS_LENGTH = 0, 1, 2, 4, 8
#: Descriptor fields per chunk (int64): where it is, its geometry, its lanes, its rows.
DESC_OFFSET, DESC_LENGTH, DESC_TOKENS, DESC_LANES, DESC_LANE_BASE, DESC_ROW_START, DESC_STORED_RAW, DESC_FIELDS = range(8)

# The same numbers as the kernels see them (Triton reads only constexpr globals).
_MAXBITS = tl.constexpr(MAXBITS)
_TABLE_SLOTS = tl.constexpr(TABLE_SLOTS)
_STATUS_HEADER = tl.constexpr(STATUS_HEADER)
_STATUS_TABLE = tl.constexpr(STATUS_TABLE)
_STATUS_LANES = tl.constexpr(STATUS_LANES)
_STATUS_LENGTH = tl.constexpr(STATUS_LENGTH)
_DESC_OFFSET = tl.constexpr(DESC_OFFSET)
_DESC_LENGTH = tl.constexpr(DESC_LENGTH)
_DESC_TOKENS = tl.constexpr(DESC_TOKENS)
_DESC_LANES = tl.constexpr(DESC_LANES)
_DESC_LANE_BASE = tl.constexpr(DESC_LANE_BASE)
_DESC_ROW_START = tl.constexpr(DESC_ROW_START)
_DESC_STORED_RAW = tl.constexpr(DESC_STORED_RAW)
_DESC_FIELDS = tl.constexpr(DESC_FIELDS)


@triton.jit
def _byte(src, at, end):
    """src[at] as int32, 0 at or past ``end`` (a chunk never makes a load leave its own bytes)."""
    return tl.load(src + at, mask=at < end, other=0).to(tl.int32)


@triton.jit
def code_table_kernel(src, desc, table, lane_start, status, HEADS: tl.constexpr, DIM: tl.constexpr,
                      RAW_BYTES: tl.constexpr, LANE_TILE: tl.constexpr):
    c = tl.program_id(0)
    off = tl.load(desc + c * _DESC_FIELDS + _DESC_OFFSET)
    length = tl.load(desc + c * _DESC_FIELDS + _DESC_LENGTH)
    tokens = tl.load(desc + c * _DESC_FIELDS + _DESC_TOKENS)
    k = tl.load(desc + c * _DESC_FIELDS + _DESC_LANES)
    base = tl.load(desc + c * _DESC_FIELDS + _DESC_LANE_BASE)
    stored_raw = tl.load(desc + c * _DESC_FIELDS + _DESC_STORED_RAW)
    end = off + length
    n = HEADS * tokens * DIM
    fixed = 2 + HEADS * DIM + n * RAW_BYTES
    version = _byte(src, off, end)
    mode = _byte(src, off + 1, end)
    bad = tl.where((length < fixed + 1) | (version != 2) | (mode > 1), _STATUS_HEADER, 0)
    if stored_raw == 1:  # the values as they are (the container checked its length): nothing to build
        bad = tl.where(length < 0, _STATUS_LENGTH, 0)
    elif mode == 1:
        bad |= tl.where(length != fixed + 1, _STATUS_LENGTH, 0)
    else:
        at = off + fixed
        lane = _byte(src, at, end) | (_byte(src, at + 1, end) << 8)
        bad |= tl.where((lane < 16) | (lane > 16384) | (k != (n + lane - 1) // tl.maximum(lane, 1)), _STATUS_HEADER, 0)
        # The code table: which symbols occur, then their lengths, 4 bits each in symbol order.
        s = tl.arange(0, 256)
        used = (_byte(src, at + 2 + (s >> 3), end) >> (s & 7)) & 1
        rank = tl.cumsum(used, 0) - used
        count = tl.sum(used, 0)
        nibbles = _byte(src, at + 34 + (rank >> 1), end)
        size = tl.where(used == 1, (nibbles >> (4 * (rank & 1))) & 15, 0)
        pad = _byte(src, at + 34 + (count >> 1), end) >> 4
        kraft = tl.sum(tl.where(size > 0, (tl.zeros_like(size) + _TABLE_SLOTS) >> tl.minimum(size, _MAXBITS), 0), 0)
        wrong_size = tl.max(tl.where((used == 1) & ((size == 0) | (size > _MAXBITS)), 1, 0), 0)
        bad |= tl.where((count < 2) | (wrong_size > 0) | (kraft != _TABLE_SLOTS) | (((count & 1) == 1) & (pad != 0)),
                        _STATUS_TABLE, 0)
        # Canonical codes: by (length, symbol), consecutive; written bit-reversed (LSB first).
        code = tl.zeros([256], tl.int32)
        first = 0
        previous = 0
        for bits in tl.static_range(1, _MAXBITS + 1):
            first = (first + previous) << 1
            here = size == bits
            before = tl.where(here, tl.cumsum(here.to(tl.int32), 0) - 1, 0)
            code = tl.where(here, first + before, code)
            previous = tl.sum(here.to(tl.int32), 0)
        reversed_code = tl.zeros([256], tl.int32)
        for b in tl.static_range(_MAXBITS):
            reversed_code |= tl.where(b < size, ((code >> b) & 1) << tl.maximum(size - 1 - b, 0), 0)
        # Every slot whose low `size` bits are a symbol's code holds that symbol (a complete code fills all 1024).
        entry = s | (size << 8)
        for r0 in tl.static_range(0, _TABLE_SLOTS // 2, 64):
            r = r0 + tl.arange(0, 64)
            slot = reversed_code[:, None] + (r[None, :] << size[:, None])
            keep = (size[:, None] > 0) & ((r[None, :] << size[:, None]) < _TABLE_SLOTS)
            keep = keep & (tl.zeros([256, 64], tl.int32) + bad == 0)
            tl.store(table + c * _TABLE_SLOTS + slot, tl.broadcast_to(entry[:, None], [256, 64]), mask=keep)
        # Lane starts (bit positions in src) from the lane lengths; they must tile the rest of the chunk.
        lanes_at = at + 34 + (count + 1) // 2
        streams = lanes_at + 2 * k
        total = tl.zeros([], tl.int64)
        for t0 in range(0, k, LANE_TILE):
            t = t0 + tl.arange(0, LANE_TILE)
            live = t < k
            bytes_ = tl.where(live, _byte(src, lanes_at + 2 * t, end) | (_byte(src, lanes_at + 2 * t + 1, end) << 8), 0)
            within = tl.cumsum(bytes_, 0) - bytes_
            tl.store(lane_start + base + t, 8 * (streams + total + within), mask=live)
            total += tl.sum(bytes_, 0)
        bad |= tl.where(streams + total != end, _STATUS_LENGTH, 0)
    tl.store(status + c, bad)


@triton.jit
def decode_kernel(src, desc, table, lane_start, status, rows, dst, row_base, HEADS: tl.constexpr, DIM: tl.constexpr,
                  WIDTH: tl.constexpr, RAW_BYTES: tl.constexpr, EMASK: tl.constexpr, ESHIFT: tl.constexpr,
                  LANES: tl.constexpr):
    c = tl.program_id(1)
    k = tl.load(desc + c * _DESC_FIELDS + _DESC_LANES)
    first_lane = tl.program_id(0) * LANES
    if (first_lane < k) & (tl.load(status + c) == 0):
        off = tl.load(desc + c * _DESC_FIELDS + _DESC_OFFSET)
        end = off + tl.load(desc + c * _DESC_FIELDS + _DESC_LENGTH)
        tokens = tl.load(desc + c * _DESC_FIELDS + _DESC_TOKENS).to(tl.int32)
        base = tl.load(desc + c * _DESC_FIELDS + _DESC_LANE_BASE)
        row_start = tl.load(desc + c * _DESC_FIELDS + _DESC_ROW_START)
        n = HEADS * tokens * DIM
        fixed = 2 + HEADS * DIM + n * RAW_BYTES
        raw_word = tl.load(desc + c * _DESC_FIELDS + _DESC_STORED_RAW)
        stored_raw = raw_word == 1  # the values as they are
        coded = (_byte(src, off + 1, end) == 0) & (raw_word == 0)  # else one symbol stands for every value
        single = _byte(src, off + fixed, end)
        lane = first_lane + tl.arange(0, LANES)
        live_lane = lane < k
        coded_lanes = (tl.zeros([LANES], tl.int32) + coded.to(tl.int32)) == 1  # a block, for masks
        pos = tl.load(lane_start + base + lane, mask=live_lane & coded_lanes, other=0)
        stop = tl.load(lane_start + base + lane + 1, mask=live_lane & (lane + 1 < k) & coded_lanes, other=8 * end)
        steps = ((n - first_lane + k - 1) // k).to(tl.int32)
        k32 = k.to(tl.int32)
        for j in range(steps):
            i = j * k32 + lane
            live = live_lane & (i < n)
            byte = pos >> 3
            window = (_byte(src, byte, end) | (_byte(src, byte + 1, end) << 8) | (_byte(src, byte + 2, end) << 16))
            slot = (window >> (pos & 7).to(tl.int32)) & (_TABLE_SLOTS - 1)
            entry = tl.load(table + c * _TABLE_SLOTS + slot, mask=live & coded_lanes, other=0)
            sym = tl.where(coded_lanes, entry & 255, single)
            pos += tl.where(live, (entry >> 8), 0).to(tl.int64)
            row = i // DIM
            d = i % DIM
            ref = _byte(src, off + 2 + (row // tokens) * DIM + d, end)
            byte_ = ((sym & (255 - EMASK)) | ((sym + (ref << ESHIFT)) & EMASK)) & 255
            raw_at = off + 2 + HEADS * DIM + i.to(tl.int64) * RAW_BYTES
            if WIDTH == 2:
                r = _byte(src, raw_at, end)
                value = ((r & 0x80) << 8) | (byte_ << 7) | (r & 0x7F)
            elif WIDTH == 4:
                r = _byte(src, raw_at, end) | (_byte(src, raw_at + 1, end) << 8) | (_byte(src, raw_at + 2, end) << 16)
                value = ((r & 0x800000) << 8) | (byte_ << 23) | (r & 0x7FFFFF)
            else:
                value = byte_
            if stored_raw:
                at = off + i.to(tl.int64) * WIDTH
                value = _byte(src, at, end)
                for b in tl.static_range(1, WIDTH):
                    value |= _byte(src, at + b, end) << (8 * b)
            target = tl.load(rows + row_start + row, mask=live, other=-1)
            tl.store(dst + row_base + target + d, value.to(dst.dtype.element_ty), mask=live & (target >= 0))
        if coded:
            wrong = live_lane & ((pos > stop) | (stop - pos >= 8))
            tl.atomic_or(status + c, tl.where(tl.max(wrong.to(tl.int32), 0) > 0, _STATUS_LANES, 0))
